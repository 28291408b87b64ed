"""Conformance of gradient clipping by the global norm (``clip_grad_norm_(module, max_norm,
norm_type=2.0)``, CONTRACT.md), against reference/data_parallel.py, on fully sharded modules, on
the module of a DataParallel (replicated gradients: each counted once, not once per rank) and on a
tensor-parallel MLP (shards summed over the group, the row layer's whole bias counted once).

The bugs teams ship here leave the loss curve looking normal: a norm computed over the local shard
only (pytorch#170862: FSDP2 returned a local norm; torchtitan#596: clipping saw one pipeline
stage), a tied weight counted twice (Megatron-LM#7227), replicated parameters counted once per rank
(ROCm/TransformerEngine#715), an infinity norm gone wrong (torchrec#3199 reported one always 1.0). The
clipping factor is then wrong, on every rank or on some.

Each test draws a training example (conformance.examples.training_examples: the MLP or the model
with tied weights, a frozen parameter, a parameter unused on some steps and buffers; float32 or
float64; SGD with momentum or AdamW; 1-2 steps of 1-3 micro-batches), a norm type (2, 1 or inf) and max_norm as
a multiple of the first step's norm (0.25 and 0.5 clip, 4 does not); the ranks shard every unit
and the root (harness/rank/programs/fully_sharded.py), or wrap the model in their DataParallel
(harness/rank/programs/data_parallel.py), and call ``clip_grad_norm_`` after the step's backwards. In the driver, step by step:

* the norm each rank returns is the norm of the averaged full gradient at the ranks' own state
  before the step (reference ``total_norm`` of ``evaluate``'s gradients), within the norm of the
  gradients' own bound plus the rounding of the norm's sum, and bitwise the same on every rank;
* the full parameters after the step follow one process that clips the same way
  (``reference.data_parallel.train`` with ``clip``), within the bounds of reference/data_parallel.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.data_parallel as ref
import parallelism_conformance.reference.tensor_parallel as ref_tp
from parallelism_conformance.conformance.examples import Layout, TrainingExample, training_examples
from parallelism_conformance.conformance.tensor_parallel_examples import examples as tp_examples
from parallelism_conformance.conformance.test_pipeline_parallel import dense as pipeline_dense
from parallelism_conformance.conformance.test_pipeline_parallel import examples as pipeline_examples
from parallelism_conformance.conformance.test_pipeline_parallel import run_step as run_pipeline_step
from parallelism_conformance.conformance.trajectory import check_state_after_step
from parallelism_conformance.conformance.verdict import Judge, run_or_skip
from parallelism_conformance.harness.rank import models
from parallelism_conformance.reference.tolerance import unit_roundoff

NORM_TYPES = (2.0, 1.0, math.inf)
MAX_NORM_FACTORS = (0.25, 0.5, 4.0)  # times the first step's norm: clipped, clipped, not clipped


def norm_allowance(bounds: list[torch.Tensor], norm_type: float, norm: float, dtype: torch.dtype) -> float:
    """|returned - reference norm| allowed, from every gradient element's bound (``bounds``, any
    shapes): by the triangle inequality the norm of those bounds, plus the norm's own sum, N + 2
    roundings of relative size u over N elements (Higham §4.2), where the ranks sum in another order
    (or in the gradients' dtype)."""
    flat = [b.reshape(-1).to(torch.float64) for b in bounds]
    elements = sum(b.numel() for b in flat)
    spread = float(torch.linalg.vector_norm(torch.cat(flat), norm_type)) if flat else 0.0
    return spread + (elements + 2) * unit_roundoff(dtype) * norm + torch.finfo(dtype).tiny


def norm_atol(evaluation: ref.Evaluation, norm_type: float, norm: float, dtype: torch.dtype) -> float:
    """``norm_allowance`` with ``grad_atol`` (the same for every element of a parameter) as the bounds."""
    return norm_allowance(
        [ref.grad_atol(evaluation, name) * torch.ones(g.numel(), dtype=torch.float64) for name, g in evaluation.grads.items()],
        norm_type,
        norm,
        dtype,
    )


def clipped_atol(dense: torch.Tensor, atol, coefficient: float, allowed: float, norm: float, dtype: torch.dtype) -> torch.Tensor:
    """A clipped gradient against ``dense`` times the coefficient: the gradient's own bound scaled
    by it, the coefficient's error from the norm's (at most coefficient x allowed / N), and the
    product's rounding."""
    magnitude = dense.abs().to(torch.float64) * coefficient
    return (coefficient * atol + magnitude * allowed / max(norm, 1e-300) + unit_roundoff(dtype) * magnitude).to(torch.float64)


PROGRAMS = {"fully_sharded": ("fully_sharded:train", {}), "data_parallel": ("data_parallel:train", {"bucket_size_mb": None})}


def check_norm(judge: Judge, who: str, norm, want: float, allowed: float, truth: str, rule: str) -> torch.Tensor:
    """What clip_grad_norm_ returned (``norm``) is a floating tensor of one element within
    ``allowed`` of ``want``; returned as a 0-d tensor for the bitwise comparison across ranks."""
    if not torch.is_tensor(norm) or norm.numel() != 1 or not norm.is_floating_point():
        judge.fail(f"{who}: clip_grad_norm_ returned {norm!r}; the contract asks for the total norm as a floating tensor of one element")
    if not abs(float(norm) - want) <= allowed:
        judge.fail(
            f"{who}: clip_grad_norm_ returned the norm {float(norm)!r}, {truth} {want!r} (allowed difference "
            f"{allowed:.3g}; ratio {float(norm) / want if want else math.inf:.4g}): {rule}"
        )
    return norm.reshape(())


@dataclass(frozen=True)
class ClipExample:
    """A training example clipped after every step's backwards: ``norm_type`` and max_norm as
    ``max_norm_factor`` times the first step's norm."""

    training: TrainingExample
    micro_batches: int
    norm_type: float
    max_norm_factor: float

    def batch(self) -> dict:
        example = self.training
        return models.make_batch(example.model, example.world_size * example.per_rank_batch * self.micro_batches, example.data_seed)

    @cached_property
    def clip(self) -> dict:
        example = self.training
        first = ref.evaluate(models.build(example.model, example.seed), self.batch(), example.world_size, self.micro_batches)
        norm = float(ref.total_norm(list(first.grads.values()), self.norm_type))
        return {"max_norm": self.max_norm_factor * norm + 1e-3, "norm_type": self.norm_type}

    def __str__(self) -> str:
        return (
            f"{self.training}, micro_batches={self.micro_batches}, norm_type={self.norm_type}, "
            f"max_norm={self.clip['max_norm']:.6g} ({self.max_norm_factor} x the first step's norm)"
        )


def rank_inputs(example: ClipExample, layout: str) -> list[dict]:
    """What each rank's program (``PROGRAMS[layout]``) gets: its slices of the micro-batches."""
    training, n = example.training, example.training.world_size
    micro = [ref.split_batch(b, n) for b in ref.split_micro_batches(example.batch(), example.micro_batches)]
    return [
        {
            "model": training.model,
            "seed": training.seed,
            "optimizer": training.optimizer,
            "steps": training.steps,
            "batches": [slices[r] for slices in micro],
            "clip": example.clip,
            **PROGRAMS[layout][1],
        }
        for r in range(n)
    ]


@pytest.mark.capability("grad_clipping")
@pytest.mark.parametrize("layout", PROGRAMS)
@given(data=st.data())
def test_the_norm_is_global_and_every_rank_clips_by_it(layout, data, ranks, target, request):
    example = ClipExample(
        data.draw(training_examples(target.max_world_size, max_steps=2), label="example"),
        data.draw(st.integers(1, 3), label="micro_batches"),
        data.draw(st.sampled_from(NORM_TYPES), label="norm_type"),
        data.draw(st.sampled_from(MAX_NORM_FACTORS), label="max_norm / first norm"),
    )
    judge = Judge(str(example), target.reproduce(request.node.nodeid))
    n = example.training.world_size
    outputs = run_or_skip(judge, ranks, Layout(n), PROGRAMS[layout][0], rank_inputs(example, layout))
    judge_clipping(judge, example, outputs, target.plan.device_type(n))


def judge_clipping(judge: Judge, clipped: ClipExample, outputs: dict, device: str = "cpu") -> None:
    """Step by step: every rank's returned norm and its full parameters after the step (the module
    docstring)."""
    example, micro_batches, norm_type, clip = clipped.training, clipped.micro_batches, clipped.norm_type, clipped.clip
    n, batch, max_norm = example.world_size, clipped.batch(), clip["max_norm"]
    model = models.build(example.model, example.seed)
    dtype = next(model.parameters()).dtype
    exact = {name for name, p in model.named_parameters() if not p.requires_grad} | {n for n, _ in model.named_buffers()}
    expected = ref.train(model, example.optimizer, batch, example.steps, micro_batches, clip=clip)
    before = expected.initial
    for s in range(example.steps):
        step = f"step {s + 1}"
        truth = ref.evaluate(ref.load_state(models.build(example.model, 0), before), batch, n, micro_batches, device=device)
        want = float(ref.total_norm(list(truth.grads.values()), norm_type))
        atol = norm_atol(truth, norm_type, want, dtype)
        norms = {}
        for r in range(n):
            got = outputs[r]["steps"][s]
            norms[r] = check_norm(
                judge,
                f"rank {r} at {step}",
                got["norm"],
                want,
                atol,
                "the norm of the averaged full gradient is",
                "the norm must count every element of every gradient once, on every rank",
            )
            check_state_after_step(
                judge,
                r,
                got["state"],
                expected,
                s,
                exact,
                f"clipped by max_norm {max_norm:.6g}; one process clipping the same way on the global batch",
            )
        judge.bitwise_identical(norms, what=f"the norm returned at {step}")
        for name in expected.states[s]:
            judge.bitwise_identical({r: outputs[r]["steps"][s]["state"][name] for r in range(n)}, what=f"'{name}' after {step}")
        before = outputs[0]["steps"][s]["state"]


@pytest.mark.capability("grad_clipping")
@given(data=st.data())
def test_a_tensor_parallel_mlp_counts_its_replicated_bias_once(data, ranks, target, reproduce):
    """The layout of tensor parallelism (CONTRACT.md's TensorParallelMLP: fc1 column parallel, fc2
    row parallel): the norm of the dense MLP's gradients, where each member holds its shards of
    both weights and of fc1's bias, and fc2's whole bias (ROCm/TransformerEngine#715 counted such
    replicated parameters once per member). Checked: every member's returned norm against the dense
    gradients' norm, bitwise the same on every member, and every clipped gradient shard against the
    dense one times min(1, max_norm / (N + 1e-6))."""
    example = data.draw(tp_examples(target.max_world_size, "ffn"), label="example")
    norm_type = data.draw(st.sampled_from(NORM_TYPES), label="norm_type")
    factor = data.draw(st.sampled_from(MAX_NORM_FACTORS), label="max_norm / norm")
    t, n = example.tensors(), example.n
    (w1, b1), (w2, b2) = t["params"]
    dense = ref_tp.mlp(t["x"], (w1, b1), (w2, b2), t["g"])
    atol = ref_tp.mlp_atol(t["x"], (w1, b1), (w2, b2), t["g"], n)
    keys = [k for k in ("grad_fc1_weight", "grad_fc1_bias", "grad_fc2_weight", "grad_fc2_bias") if k in dense]
    want = float(ref.total_norm([dense[k] for k in keys], norm_type))
    max_norm = factor * want + 1e-3
    allowed = norm_allowance([atol[k] for k in keys], norm_type, want, example.dtype)
    coefficient = min(1.0, max_norm / (want + 1e-6))
    judge = Judge(f"{example}, norm_type={norm_type}, max_norm={max_norm:.6g} ({factor} x the norm)", reproduce)
    weights = {"fc1_weight": w1, "fc1_bias": b1, "fc2_weight": w2, "fc2_bias": b2}
    outputs = run_or_skip(
        judge,
        ranks,
        example.layout,
        "tensor_parallel:clip",
        [
            {"dense": weights, "options": {}, "x": t["x"], "grad_output": t["g"], "clip": {"max_norm": max_norm, "norm_type": norm_type}}
            for _ in range(n)
        ],
    )
    norms = {}
    for i, rank in enumerate(example.layout.ranks):
        got = outputs[rank]
        norms[rank] = check_norm(
            judge,
            f"rank {rank}",
            got["norm"],
            want,
            allowed,
            "the dense MLP's gradients have",
            "each member's shards count once, and fc2's bias, whole on every member, once in all",
        )
        for prefix, split in (("fc1_", ref_tp.column_shard), ("fc2_", ref_tp.row_shard)):
            gw, gb = split(dense["grad_" + prefix + "weight"], dense.get("grad_" + prefix + "bias"), n, i)
            tw, tb = split(atol["grad_" + prefix + "weight"], atol.get("grad_" + prefix + "bias"), n, i)
            for key, g, tol in (("weight", gw, tw), ("bias", gb, tb)):
                if g is None:
                    continue
                judge.tensor(
                    got["grad_" + prefix + key],
                    g * coefficient,
                    atol=clipped_atol(g, tol, coefficient, allowed, want, example.dtype),
                    what=f"rank {rank} {prefix}{key} gradient after clipping (its shard of the dense gradient "
                    f"times min(1, max_norm / (N + 1e-6)) = {coefficient:.6g})",
                )
    judge.bitwise_identical(norms, what="the norm returned")


@pytest.mark.capability("grad_clipping")
@given(data=st.data())
def test_pipeline_stages_clip_by_the_norm_of_every_stage(data, ranks, target, request):
    """A pipeline (conformance/test_pipeline_parallel.py's examples: every schedule, v chunks per
    rank) after one pipeline_step: every rank calls clip_grad_norm_(its stages, max_norm,
    norm_type, pp_group=the pipeline's group), torchtitan's pp_mesh. The norm is the one of the
    whole model's gradients, not of the rank's own stages (torchtitan#596, #649), bitwise the same
    on every rank, and every stage's gradients are the dense ones times min(1, max_norm / (N + 1e-6))."""
    example = data.draw(pipeline_examples(target.max_world_size), label="example")
    norm_type = data.draw(st.sampled_from(NORM_TYPES), label="norm_type")
    factor = data.draw(st.sampled_from(MAX_NORM_FACTORS), label="max_norm / norm")
    expected = pipeline_dense(example)
    want = float(ref.total_norm([expected.grads[name] for name in sorted(expected.grads)], norm_type))
    example = dataclasses.replace(example, clip=(factor * want + 1e-3, norm_type))
    judge = Judge(str(example), target.reproduce(request.node.nodeid))
    judge_pipeline_clipping(judge, example, run_pipeline_step(judge, ranks, example))


def judge_pipeline_clipping(
    judge: Judge,
    example,
    outputs: dict,
    counted: list[str] | None = None,
    why: str = "every stage's gradients count, summed over the pipeline with pp_group, not this rank's stages alone",
) -> None:
    """Every rank's returned norm and clipped gradients after one pipeline_step of ``example``
    (its ``clip``: max_norm, norm_type), against the dense model's. ``counted``: the stable names
    whose gradients make the norm (default: all; a tied weight's second copy is left out)."""
    expected = pipeline_dense(example)
    names = counted or sorted(expected.grads)
    max_norm, norm_type = example.clip
    want = float(ref.total_norm([expected.grads[name] for name in names], norm_type))
    coefficient = min(1.0, max_norm / (want + 1e-6))
    allowed = norm_allowance(
        [expected.grad_atol[name] * torch.ones(expected.grads[name].numel(), dtype=torch.float64) for name in names],
        norm_type,
        want,
        torch.float64,
    )
    norms = {}
    for r in range(example.num_ranks):
        got = outputs[r]
        norms[r] = check_norm(judge, f"rank {r}", got["norm"], want, allowed, "the whole model's gradients have", why)
        for name, g in got["grads"].items():
            dense = expected.grads[name]
            judge.tensor(
                g,
                dense * coefficient,
                atol=clipped_atol(dense, expected.grad_atol[name], coefficient, allowed, want, torch.float64),
                what=f"rank {r} gradient of '{name}' after clipping (the dense gradient times min(1, max_norm / "
                f"(N + 1e-6)) = {coefficient:.6g})",
            )
    judge.bitwise_identical(norms, what="the norm returned")
