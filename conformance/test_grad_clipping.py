"""Conformance of gradient clipping by the global norm (``clip_grad_norm_(module, max_norm,
norm_type=2.0)``, CONTRACT.md), against reference/data_parallel.py, on fully sharded modules and
on the module of a DataParallel (replicated gradients: each counted once, not once per rank).

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

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference.data_parallel as ref
from conformance.examples import Layout, training_examples
from conformance.verdict import Judge, check_names, run_or_skip
from harness.rank import models
from reference.tolerance import unit_roundoff

NORM_TYPES = (2.0, 1.0, math.inf)
MAX_NORM_FACTORS = (0.25, 0.5, 4.0)  # times the first step's norm: clipped, clipped, not clipped


def norm_atol(evaluation: ref.Evaluation, norm_type: float, norm: float, dtype: torch.dtype) -> float:
    """|returned - reference norm| allowed: by the triangle inequality the norm of the gradients'
    elementwise bound (``grad_atol``, the same for every element of a parameter), plus the norm's
    own sum: N + 2 roundings of relative size u over N elements (Higham §4.2), where the ranks sum
    in another order (or in the gradients' dtype)."""
    bounds = [float(ref.grad_atol(evaluation, name)) * torch.ones(g.numel(), dtype=torch.float64)
              for name, g in evaluation.grads.items()]
    elements = sum(g.numel() for g in evaluation.grads.values())
    spread = float(torch.linalg.vector_norm(torch.cat(bounds), norm_type)) if bounds else 0.0
    return spread + (elements + 2) * unit_roundoff(dtype) * norm + torch.finfo(dtype).tiny


PROGRAMS = {"fully_sharded": ("fully_sharded:train", {}),
            "data_parallel": ("data_parallel:train", {"bucket_size_mb": None})}


@pytest.mark.capability("grad_clipping")
@pytest.mark.parametrize("layout", PROGRAMS)
@given(data=st.data())
def test_the_norm_is_global_and_every_rank_clips_by_it(layout, data, ranks, target, request):
    example = data.draw(training_examples(target.max_world_size, max_steps=2), label="example")
    micro_batches = data.draw(st.integers(1, 3), label="micro_batches")
    norm_type = data.draw(st.sampled_from(NORM_TYPES), label="norm_type")
    factor = data.draw(st.sampled_from(MAX_NORM_FACTORS), label="max_norm / first norm")
    n = example.world_size
    batch = models.make_batch(example.model, n * example.per_rank_batch * micro_batches, example.data_seed)
    micro = [ref.split_batch(b, n) for b in ref.split_micro_batches(batch, micro_batches)]
    first = ref.evaluate(models.build(example.model, example.seed), batch, n, micro_batches)
    max_norm = factor * float(ref.total_norm(list(first.grads.values()), norm_type)) + 1e-3
    clip = {"max_norm": max_norm, "norm_type": norm_type}
    judge = Judge(f"{example}, micro_batches={micro_batches}, norm_type={norm_type}, max_norm={max_norm:.6g} "
                  f"({factor} x the first step's norm)", target.reproduce(request.node.nodeid))
    program, options = PROGRAMS[layout]
    outputs = run_or_skip(judge, ranks, Layout(n), program, [
        {"model": example.model, "seed": example.seed, "optimizer": example.optimizer, "steps": example.steps,
         "batches": [slices[r] for slices in micro], "clip": clip, **options} for r in range(n)])
    model = models.build(example.model, example.seed)
    dtype = next(model.parameters()).dtype
    exact = {name for name, p in model.named_parameters() if not p.requires_grad} | {n for n, _ in model.named_buffers()}
    expected = ref.train(model, example.optimizer, batch, example.steps, micro_batches, clip=clip)
    before = expected.initial
    for s in range(example.steps):
        step = f"step {s + 1}"
        truth = ref.evaluate(ref.load_state(models.build(example.model, 0), before), batch, n, micro_batches,
                             device=target.plan.device_type(n))
        want = float(ref.total_norm(list(truth.grads.values()), norm_type))
        atol = norm_atol(truth, norm_type, want, dtype)
        norms = {}
        for r in range(n):
            got = outputs[r]["steps"][s]
            norm = got["norm"]
            if not torch.is_tensor(norm) or norm.numel() != 1 or not norm.is_floating_point():
                judge.fail(f"rank {r} at {step}: clip_grad_norm_ returned {norm!r}; the contract asks for the total "
                           f"norm as a floating tensor of one element")
            norms[r] = norm.reshape(())
            if not abs(float(norm) - want) <= atol:
                judge.fail(f"rank {r} at {step}: clip_grad_norm_ returned the norm {float(norm)!r}, the norm of the "
                           f"averaged full gradient is {want!r} (allowed difference {atol:.3g}; ratio "
                           f"{float(norm) / want if want else math.inf:.4g}): the norm must count every element of "
                           f"every gradient once, on every rank")
            check_names(judge, got["state"], expected.states[s], f"rank {r} after {step}: full parameters and buffers")
            for name, value in expected.states[s].items():
                judge.tensor(got["state"][name], value,
                             atol=None if name in exact else ref.param_atol(expected, s + 1, name),
                             what=f"rank {r} '{name}' after {step} (clipped by max_norm {max_norm:.6g}; one process "
                                  f"clipping the same way on the global batch)")
        judge.bitwise_identical(norms, what=f"the norm returned at {step}")
        for name in expected.states[s]:
            judge.bitwise_identical({r: outputs[r]["steps"][s]["state"][name] for r in range(n)},
                                    what=f"'{name}' after {step}")
        before = outputs[0]["steps"][s]["state"]
