"""Conformance of initialising a fully sharded model built on the meta device (capability
``fsdp_init``): ``init_sharded(module, seed, device)`` must give every rank its pieces of the
parameters one process draws (reference/initialisation.py: torch.manual_seed(seed), then each
submodule's reset_parameters() in modules() order), and leave the rank's own random stream as it
found it.

Reported bug this is for: pytorch/torchtitan#3106 (FSDP2 with CPU offload gave every rank identical
random shards at initialisation: each rank drew its own shard from the same seed, so the sharded
parameter was one shard repeated, a model no single process would build). Nothing fails: the run
trains a worse-initialised model.

Each example draws n = 1-4 ranks, a model of Linear layers (``mlp``, ``gelu_mlp``, ``stacked_mlp``)
whose sizes need not divide by n, float32 or float64, a seed and each rank's own stream seed. The
rank (harness/rank/programs/fully_sharded.py, init_from_meta) builds the model under
``torch.device("meta")``, shards every unit and the root, seeds its default generator with its
stream seed, calls init_sharded, draws four numbers, and trains one SGD step on its slice. In the
driver: the full parameters bitwise the single process's, bitwise the same on every rank; the four
numbers the stream's first four; the losses and the parameters after the step as one process's on
the global batch (reference/data_parallel.py's bounds).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.data_parallel as ref
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.verdict import Judge, check_names
from parallelism_conformance.harness.rank import models
from parallelism_conformance.reference.initialisation import default_initialisation


@st.composite
def init_examples(draw, max_world_size: int) -> dict:
    kind = draw(st.sampled_from(["mlp", "gelu_mlp", "stacked_mlp"]), label="model kind")
    dtype = draw(st.sampled_from(["float32", "float64"]), label="dtype")
    if kind == "mlp":
        model = {"kind": kind, "inputs": draw(st.integers(1, 6)), "hidden": draw(st.integers(1, 7)), "outputs": draw(st.integers(1, 5))}
    elif kind == "gelu_mlp":
        model = {"kind": kind, "width": draw(st.integers(1, 5)), "hidden": draw(st.integers(1, 7))}
    else:
        model = {"kind": kind, "width": draw(st.integers(1, 5)), "layers": draw(st.integers(1, 3))}
    return {
        "n": draw(st.integers(1, max(1, min(4, max_world_size))), label="world size"),
        "model": {**model, "dtype": dtype},
        "per_rank": draw(st.integers(1, 3), label="samples per rank"),
        "optimizer": {"name": "sgd", "lr": draw(st.sampled_from([0.1, 0.5]), label="lr"), "momentum": 0.0, "weight_decay": 0.0},
        "seed": draw(st.integers(0, 2**16), label="seed"),
        "data_seed": draw(st.integers(0, 2**16)),
        "stream_seeds": draw(st.lists(st.integers(0, 2**16), min_size=4, max_size=4), label="stream seeds"),
    }


def stream_start(seed: int) -> torch.Tensor:
    """The first four float64 numbers torch's default generator gives after torch.manual_seed(seed)."""
    return torch.rand(4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def repeated_pieces(full: torch.Tensor, n: int) -> bool:
    """Whether ``full``, cut in n as a sharding cuts it (flat pieces, as the contract's fully_shard
    may; row blocks, as FSDP2's Shard(0)), the short last ones left out, is one piece repeated."""
    if n < 2 or full.numel() == 0:
        return False
    flat, size = full.reshape(-1), -(-full.numel() // n)
    for pieces in ([flat[r * size : (r + 1) * size] for r in range(n)], list(torch.chunk(full, n, dim=0))):
        whole = [p for p in pieces if p.shape == pieces[0].shape]
        if len(whole) > 1 and all(torch.equal(p, whole[0]) for p in whole[1:]):
            return True
    return False


@pytest.mark.capability("fsdp_init")
@given(data=st.data())
def test_a_model_built_on_meta_is_initialised_as_one_process_would(data, ranks, target, request):
    example = data.draw(init_examples(target.max_world_size), label="example")
    judge = Judge(", ".join(f"{k}={v}" for k, v in example.items()), target.reproduce(request.node.nodeid))
    n = example["n"]
    batch = models.make_batch(example["model"], n * example["per_rank"], example["data_seed"])
    slices = ref.split_batch(batch, n)
    outputs = judge.run(
        ranks,
        Layout(n),
        "fully_sharded:init_from_meta",
        [
            {
                "model": example["model"],
                "seed": example["seed"],
                "stream_seed": example["stream_seeds"][r],
                "optimizer": example["optimizer"],
                "batches": [slices[r]],
            }
            for r in range(n)
        ],
    )
    dense = models.build(example["model"], 0)
    initial = default_initialisation(dense, example["seed"])
    for r in range(n):
        got = outputs[r]
        judge.tensor(
            got["stream"],
            stream_start(example["stream_seeds"][r]),
            what=f"rank {r}: the first four draws of its own stream after init_sharded (it must leave torch's "
            "default generator as it found it)",
        )
        check_names(judge, got["initial"], initial, f"rank {r} after init_sharded: full parameters")
        for name, want in initial.items():
            if repeated_pieces(got["initial"][name], n) and not repeated_pieces(want, n):
                judge.fail(
                    f"rank {r} '{name}' after init_sharded: every rank holds the same piece, where one process's "
                    f"parameter differs piece by piece: each rank drew its own piece from the seed instead of "
                    f"its piece of the whole parameter's draw (pytorch/torchtitan#3106)"
                )
            judge.tensor(
                got["initial"][name],
                want,
                what=f"rank {r} '{name}' after init_sharded (bitwise: torch.manual_seed(seed), then each "
                "submodule's reset_parameters() in modules() order, as one process draws it)",
            )
    for name in initial:
        judge.bitwise_identical({r: outputs[r]["initial"][name] for r in range(n)}, what=f"'{name}' after init_sharded")
    expected = ref.train(dense, example["optimizer"], batch, 1)
    truth = ref.evaluate(ref.load_state(models.build(example["model"], 0), expected.initial), batch, n, 1, device=target.plan.device_type(n))
    for r in range(n):
        got = outputs[r]
        judge.tensor(
            got["loss"].reshape(-1),
            truth.slice_losses[r],
            atol=ref.loss_atol(truth, r),
            what=f"rank {r}'s loss after init_sharded (the mean over its own slice)",
        )
        for name, want in expected.states[0].items():
            judge.tensor(
                got["after"][name],
                want,
                atol=ref.param_atol(expected, 1, name),
                what=f"rank {r} '{name}' after one step from the initialised model (one process on the global batch)",
            )
