"""Conformance of fully sharded data parallelism (``fully_shard(module, group=None,
reshard_after_forward=True)`` and ``full_parameters(module)``, CONTRACT.md), against
reference/data_parallel.py. Capability ``fully_sharded``: the default, ZeRO-3 (parameters gathered
for forward and again for backward). Capability ``zero2``: ``reshard_after_forward=False``, ZeRO-2's
traffic (what forward gathered is kept until backward); the same checks, since both end every step
with the same sharded state. An implementation of ZeRO-3 alone claims only ``fully_sharded``.

Each test draws an example (world size n, a model from harness/rank/models.py (an MLP, or the model with
tied weights, a frozen parameter, a parameter unused on some steps, inside a unit that ran too, and
buffers), 1-4 steps of 1-3 micro-batches each (gradient accumulation: one backward per
micro-batch, then one optimizer step, as FSDP2 allows), SGD with momentum or AdamW, float32 or
float64) and has the ranks shard every unit, then the root, and train on their slices of the global
micro-batches (harness/rank/programs/fully_sharded.py). In the driver, step by step and rank by rank:

* each rank's losses are its slices' losses (one process, from the state before the step);
* the full parameters and buffers after every step follow one process training on the global
  batch (the bounds of reference/data_parallel.py), bitwise identical on every rank;
* memory, counted exactly: the elements a rank holds (trainable parameters, their gradients, the
  optimizer state) are at most 1/n of what one process holds, plus one unit's full parameters, plus
  padding of one row per parameter and tensor kind (ZeRO-3: Rajbhandari et al. 2020, sec. 5).

Under ``--scope cs336`` the examples are the CS336 2026 handout's (``handout_example``).

Capability ``fsdp_compute_dtype``: ``compute_dtype`` float16 or bfloat16 (the handout's
``get_fsdp(module, compute_dtype)``, FSDP2's ``param_dtype``), one step on examples where nothing
computed in low precision can round (reference/mixed_precision.py): each rank's losses bitwise,
the float32 masters within the few roundings of the average and the update, every parameter,
gradient and optimizer state still float32, and memory sharded as above. The audit (conformance/audit/test_fully_sharded.py)
holds the gathers to the compute dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.data_parallel as ref
from parallelism_conformance.conformance import by_design
from parallelism_conformance.conformance.compute_dtype import compute_dtype_examples, judge_one_step, run_one_step
from parallelism_conformance.conformance.examples import Layout, handout_fsdp_model, training_examples
from parallelism_conformance.conformance.examples import TrainingExample as Example
from parallelism_conformance.conformance.library_configurations import drawn
from parallelism_conformance.conformance.verdict import Judge, check_names, run_or_skip
from parallelism_conformance.harness.rank import models
from parallelism_conformance.harness.rank.programs.fully_sharded import units

PROGRAM = "fully_sharded:train"
STATE_TENSORS = {"sgd": 1, "adamw": 2}  # momentum buffer; exp_avg and exp_avg_sq


def memory_bound(example: Example) -> tuple[int, int, str]:
    """(what one process holds, the most one rank may hold, the formula)."""
    net = models.build(example.model, example.seed)
    trainable = [p for p in net.parameters() if p.requires_grad]
    kinds = 2 + STATE_TENSORS[example.optimizer["name"]]  # parameter, gradient, state tensors
    one = kinds * sum(p.numel() for p in trainable)
    n = example.world_size
    padding = kinds * sum(math.ceil(p.numel() / p.shape[0]) if p.dim() else 1 for p in trainable)
    unit_sizes = [sum(p.numel() for p in u.parameters() if p.requires_grad) for u in units(net)]
    in_units = {id(p) for u in units(net) for p in u.parameters()}
    unit_sizes.append(sum(p.numel() for p in trainable if id(p) not in in_units))  # the root's own
    largest = max(unit_sizes)
    bound = math.ceil(one / n) + padding + largest
    return (
        one,
        bound,
        (f"ceil({one}/{n}) + {padding} (a row of padding per parameter and tensor kind) + {largest} (the largest unit's full parameters)"),
    )


def check_sharded_memory(judge: Judge, who: str, held, memory: tuple[int, int, str]) -> None:
    """``held`` ({kind: elements}, as the rank program counts them) within ``memory_bound``'s bound."""
    one, bound, formula = memory
    total = sum(held.values()) if isinstance(held, dict) else -1
    if total > bound:
        judge.fail(
            f"{who} holds {total} elements ({held}); one process holds {one}, a fully sharded rank at most "
            f"{formula} = {bound}: something is replicated, not sharded"
        )


@pytest.mark.capability("fully_sharded")
@given(data=st.data())
def test_training_matches_one_process_and_memory_is_sharded(data, ranks, target, request):
    check_training(data, ranks, target, request, reshard=True)


@pytest.mark.capability("zero2")
@given(data=st.data())
def test_zero2_training_matches_one_process_and_memory_is_sharded(data, ranks, target, request):
    """reshard_after_forward=False (the keyword is passed): the same results as ZeRO-3."""
    check_training(data, ranks, target, request, reshard=False)


# A fixed example of the contract's "a parameter no forward used keeps .grad None" where the
# parameter (aux.linear.weight, unused on even steps) sits in a unit that ran (aux.scale is used on
# every step): a unit that reduce-scatters zeros for it gives it a zero .grad, and AdamW's moments
# and weight decay then move it. Drawn examples reach this case too, but 25 derandomized ones did
# not (found by an outside author's FSDP, which only thorough's 150 caught). One micro-batch per
# step: the skip alternates by forward call, so with two or more every step uses it.
UNUSED_INSIDE_A_UNIT = dict(
    model={"kind": "tied_lm", "vocab": 5, "width": 3, "hidden": 4, "context": 2, "dtype": "float64", "skips_in_unit": True},
    steps=3,
    optimizer={"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-3, "weight_decay": 0.01},
    per_rank_batch=1,
    seed=3,
    data_seed=4,
)


@pytest.mark.capability("fully_sharded")
def test_a_parameter_unused_inside_a_unit_that_ran_keeps_no_gradient(ranks, target, request):
    if target.scope == "cs336":
        pytest.skip("beyond the CS336 handout (--scope cs336): its model uses every parameter in every step")
    example = Example(world_size=min(2, target.max_world_size), **UNUSED_INSIDE_A_UNIT)
    judge_training(example, 1, ranks, target, request, reshard=True)


def check_training(data, ranks, target, request, reshard: bool) -> None:
    example = data.draw(training_examples(target.max_world_size, max_steps=4), label="example")
    # gradient accumulation: the backwards of 1-3 micro-batches before each optimizer step (an
    # implementation that replaces .grad with the latest reduce-scatter is wrong from 2 on: found by
    # an outside author's FSDP)
    micro_batches = data.draw(st.integers(1, 3), label="micro_batches")
    if target.scope == "cs336":
        example, micro_batches = handout_example(example), 1
    judge_training(example, micro_batches, ranks, target, request, reshard)


@pytest.mark.library_configuration
@pytest.mark.capability("fully_sharded")
@given(data=st.data())
def test_training_matches_one_process_in_the_configurations_users_set(data, ranks, target, request):
    """A library's adapter in a configuration drawn from its table entry (conformance/library_configurations.py)."""
    with drawn(data, ranks, "fully_sharded") as configuration:
        example = data.draw(training_examples(target.max_world_size, max_steps=4), label="example")
        judge_training(example, data.draw(st.integers(1, 3), label="micro_batches"), ranks, target, request, True, configuration)


def handout_example(example: Example) -> Example:
    """--scope cs336: the example on the handout's model (conformance.examples.handout_fsdp_model);
    one backward per step is the caller's."""
    return dataclasses.replace(example, model=handout_fsdp_model(example.model, example.world_size))


def judge_training(example: Example, micro_batches: int, ranks, target, request, reshard: bool, configuration: str = "") -> None:
    described = f"{example}, micro_batches={micro_batches}, reshard_after_forward={reshard}" + (f"; {configuration}" if configuration else "")
    judge = Judge(described, target.reproduce(request.node.nodeid))
    n = example.world_size
    batch = models.make_batch(example.model, n * example.per_rank_batch * micro_batches, example.data_seed)
    micro = [ref.split_batch(b, n) for b in ref.split_micro_batches(batch, micro_batches)]
    outputs = run_or_skip(
        judge,
        ranks,
        Layout(n),
        PROGRAM,
        [
            {
                "model": example.model,
                "seed": example.seed,
                "optimizer": example.optimizer,
                "steps": example.steps,
                "batches": [slices[r] for slices in micro],
                "reshard_after_forward": reshard,
            }
            for r in range(n)
        ],
    )
    model = models.build(example.model, example.seed)
    exact = {name for name, p in model.named_parameters() if not p.requires_grad} | {n for n, _ in model.named_buffers()}

    def trained(**design):
        scale = ranks.micro_batch_scale(micro_batches)  # 1/k for a library that divides each loss by its own count
        return ref.train(
            models.build(example.model, example.seed), example.optimizer, batch, example.steps, micro_batches, micro_batch_scale=scale, **design
        )

    judge_steps = functools.partial(judge_fully_sharded_steps, judge, example, micro_batches, outputs, batch, exact, target)
    # the contract's judgement; where it fails, a design the library declares, judged whole (conformance/by_design.py)
    by_design.judged(
        ranks.designs, lambda: judge_steps(trained()), {by_design.UNUSED_GET_ZERO_GRAD: lambda: judge_steps(trained(unused_get_zero_grad=True))}
    )


def judge_fully_sharded_steps(
    judge: Judge, example: Example, micro_batches: int, outputs: dict, batch: dict, exact: set, target, expected
) -> None:
    n = example.world_size
    memory = memory_bound(example)
    before = expected.initial
    for s in range(example.steps):
        step = f"step {s + 1}"
        truth = ref.evaluate(ref.load_state(models.build(example.model, 0), before), batch, n, micro_batches, device=target.plan.device_type(n))
        for r in range(n):
            got = outputs[r]["steps"][s]
            judge.tensor(
                got["loss"].reshape(-1),
                truth.slice_losses[r],
                atol=ref.loss_atol(truth, r),
                what=f"rank {r} losses at {step} (per micro-batch, the mean loss over its own slice)",
            )
            check_names(judge, got["state"], expected.states[s], f"rank {r} after {step}: full parameters and buffers")
            for name, want in expected.states[s].items():
                judge.tensor(
                    got["state"][name],
                    want,
                    atol=None if name in exact else ref.param_atol(expected, s + 1, name),
                    what=f"rank {r} '{name}' after {step} (full_parameters; one process on the global batch)",
                )
            check_sharded_memory(judge, f"rank {r} after {step}", got["held"], memory)
        for name in expected.states[s]:
            judge.bitwise_identical({r: outputs[r]["steps"][s]["state"][name] for r in range(n)}, what=f"'{name}' after {step}")
        before = outputs[0]["steps"][s]["state"]


@pytest.mark.capability("fsdp_compute_dtype")
@given(data=st.data())
def test_compute_dtype_computes_low_and_keeps_float32_masters(data, ranks, target, request):
    example, micro_batches, dtype_name = data.draw(compute_dtype_examples(target.max_world_size, target.scope), label="example")
    judge, expected, outputs = run_one_step(
        lambda what: Judge(what, target.reproduce(request.node.nodeid)), ranks, PROGRAM, example, micro_batches, dtype_name
    )
    memory = memory_bound(example)
    for r in range(example.world_size):
        check_sharded_memory(judge, f"rank {r}", outputs[r]["steps"][0]["held"], memory)
    judge_one_step(judge, expected, outputs, example.world_size, dtype_name, "full_parameters")
