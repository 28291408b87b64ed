"""A compute dtype in data parallelism and fully sharded data parallelism: the examples, on which
float16 and bfloat16 compute exactly (reference/mixed_precision.py), and the judgement of one step,
shared by conformance/test_data_parallel.py (``DataParallel(..., compute_dtype=d)``) and
conformance/test_fully_sharded.py (``fully_shard(..., compute_dtype=d)``)."""

from __future__ import annotations

import torch
from hypothesis import assume
from hypothesis import strategies as st

import parallelism_conformance.reference.data_parallel as ref
import parallelism_conformance.reference.mixed_precision as ref_mixed
from parallelism_conformance.conformance.examples import Layout, TrainingExample, handout_fsdp_model
from parallelism_conformance.conformance.verdict import Judge, check_names, run_or_skip
from parallelism_conformance.harness.rank import models


@st.composite
def compute_dtype_examples(draw, max_world_size: int, scope: str) -> tuple[TrainingExample, int, str]:
    """(one step of the relu_lm model, micro-batches, the compute dtype's name): sizes small enough
    that float16 and bfloat16 compute exactly (reference/mixed_precision.py), positions per slice a
    power of two, SGD with powers of two; under --scope cs336 the handout's model and one backward."""
    n = draw(st.integers(1, max_world_size), label="world_size")
    model = {
        "kind": "relu_lm",
        "vocab": draw(st.integers(2, 8), label="vocab"),
        "width": draw(st.integers(1, 4), label="width"),
        "hidden": draw(st.integers(1, 4), label="hidden"),
        "context": draw(st.sampled_from([1, 2]), label="context"),
        "tied": draw(st.booleans(), label="tied"),
        "dtype": "float32",
    }
    optimizer = {
        "name": "sgd",
        "lr": draw(st.sampled_from([2.0**-3, 2.0**-5]), label="lr"),
        "momentum": draw(st.sampled_from([0.0, 0.5]), label="momentum"),
        "weight_decay": draw(st.sampled_from([0.0, 2.0**-4]), label="weight_decay"),
    }
    micro_batches = draw(st.integers(1, 3), label="micro_batches")
    if scope == "cs336":
        model, micro_batches = handout_fsdp_model(model, n), 1
    example = TrainingExample(
        world_size=n,
        per_rank_batch=draw(st.sampled_from([1, 2]), label="per_rank_batch"),
        model=model,
        steps=1,
        optimizer=optimizer,
        seed=draw(st.integers(0, 2**16), label="seed"),
        data_seed=draw(st.integers(0, 2**16), label="data_seed"),
    )
    return example, micro_batches, draw(st.sampled_from(["float16", "bfloat16"]), label="compute_dtype")


def run_one_step(
    judge_for, ranks, program: str, example: TrainingExample, micro_batches: int, dtype_name: str, options: dict | None = None
) -> tuple[Judge, ref_mixed.OneStep, dict]:
    """The ranks' one step of ``program`` with ``compute_dtype`` and the exact reference (an
    example beyond the exact sizes is redrawn: ``assume``; one torch's own library cannot run is
    refused, ``run_or_skip``); ``judge_for(description)`` makes the judge. Returns (the judge, the reference, every rank's outputs)."""
    dtype, n = getattr(torch, dtype_name), example.world_size
    batch = models.make_batch(example.model, n * example.per_rank_batch * micro_batches, example.data_seed)
    micro = [ref.split_batch(b, n) for b in ref.split_micro_batches(batch, micro_batches)]
    per_rank = [[slices[r] for slices in micro] for r in range(n)]
    model = models.build(example.model, example.seed)
    try:
        ref_mixed.check_exact(model, per_rank, dtype)
    except ValueError:
        assume(False)  # the sizes drawn keep almost every example exact; the rare sum beyond 2^p is redrawn
    scale = ranks.micro_batch_scale(micro_batches)  # 1, or 1/k for a library that averages its micro-batches
    # 1/3 of a loss rounds in the compute dtype: such a library's exact examples take k a power of two
    assume(scale == 1.0 or micro_batches in (1, 2))
    expected = ref_mixed.one_step(model, example.optimizer, per_rank, dtype, micro_batch_scale=scale)
    judge = judge_for(f"{example}, micro_batches={micro_batches}, compute_dtype={dtype_name}")
    outputs = run_or_skip(
        judge,
        ranks,
        Layout(n),
        program,
        [
            {
                "model": example.model,
                "seed": example.seed,
                "optimizer": example.optimizer,
                "steps": 1,
                "batches": per_rank[r],
                "compute_dtype": dtype_name,
                **(options or {}),
            }
            for r in range(n)
        ],
    )
    return judge, expected, outputs


def judge_one_step(judge: Judge, expected: ref_mixed.OneStep, outputs: dict, n: int, dtype_name: str, parameters: str) -> None:
    """Each rank's losses bitwise, its logits computed in the compute dtype, the masters, their
    gradients and the optimizer state in the model's dtype, and the ``parameters`` (the full
    parameters, or the module's own) after the step within ``expected.atol``, bitwise the same on
    every rank."""
    master = str(next(iter(expected.initial.values())).dtype).removeprefix("torch.")
    for r in range(n):
        got = outputs[r]["steps"][0]
        judge.tensor(
            got["loss"].reshape(-1),
            expected.losses[r],
            what=f"rank {r} losses (per micro-batch; exact: every logit is an integer computed exactly in {dtype_name})",
        )
        if got.get("logits_dtype") not in (None, dtype_name):
            judge.fail(
                f"rank {r}: the model's forward computed its logits in {got['logits_dtype']}; with "
                f"compute_dtype={dtype_name} forward and backward run in {dtype_name}"
            )
        for kind, dtypes in got["dtypes"].items():
            if any(d != master for d in dtypes):
                judge.fail(
                    f"rank {r}: its {kind.replace('_', ' ')} are {', '.join(dtypes)}; with compute_dtype="
                    f"{dtype_name} the masters, their gradients and the optimizer state stay {master} (only "
                    f"the copies cast for forward and backward are {dtype_name})"
                )
        check_names(judge, got["state"], expected.after, f"rank {r} after the step: {parameters}")
        for name, want in expected.after.items():
            value = got["state"][name]
            if value.dtype != expected.initial[name].dtype:
                judge.fail(f"rank {r} '{name}': {parameters} hold {value.dtype}, the master is {expected.initial[name].dtype}")
            judge.tensor(
                value.double(),
                want,
                atol=expected.atol[name],
                what=f"rank {r} '{name}' after the step (the gradients exact in {dtype_name}, averaged, then "
                f"SGD on the {master} masters; the bound counts each rounding left)",
            )
    for name in expected.after:
        judge.bitwise_identical({r: outputs[r]["steps"][0]["state"][name] for r in range(n)}, what=f"'{name}'")
