"""Conformance of random streams in pipeline parallelism (capability ``pipeline_dropout``): stages whose
layers draw dropout masks from torch's default generator, each rank its own stream, seeded by the
harness before ``pipeline_step`` (harness/rank/programs/pipeline_parallel.py: train_step's rng_seed).

The contract's rule (CONTRACT.md, "pipeline_step"): a runtime runs each microbatch's forward of a
stage once, each stage's in microbatch order, and draws nothing from the generator itself. Then a
stage's masks for a microbatch are the draws its rank's stream gives at that point of the rank's
forwards: on one stage per rank, microbatch after microbatch; on several (interleaved), in the
order the rank ran its stages' forwards, which the harness's hooks on
the stage modules record (``executed``, whose order the schedule's own test judges). One process
replays each rank's stream through that order (reference/pipeline_parallel.py: dense_step's
streams). A runtime that runs a forward twice (a recompute without the saved state,
allenai/OLMo-core#828's pattern), or out of microbatch order, or draws for itself, moves the masks
and the gradients with them.

Each example draws GPipe, 1F1B or interleaved 1F1B (v stages a rank) on p = 1-4 ranks, m, the layers
and widths
(conformance/test_pipeline_parallel.py's draws), p = 0.25 or 0.5 and each rank's seed; judged as
that file's step is: the last stage's loss and every stage's gradients against the dense model under
the same masks, and the schedule run.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallelism_conformance.conformance.executed_schedule import calls_of, without_warm_up_forwards
from parallelism_conformance.conformance.test_pipeline_parallel import Example, examples, judge_step, run_step
from parallelism_conformance.conformance.verdict import Judge


def interleaved_strata(max_ranks: int) -> list[dict]:
    """Interleaved 1F1B with two stages a rank, on one rank and on two, dropout 0.5: where a runtime
    that restarts one stream for each stage it holds draws the same masks on a rank's stages (the
    K = 5 sweep caught that at 4 of 5 seeds, docs/kill-robustness.md)."""
    strata = []
    for p in sorted({1, min(2, max_ranks)}):
        m = 2 * p  # interleaved: a multiple of p
        example = Example("interleaved", p, m, 2, (1,) * (2 * p), (3,) * (2 * p + 1), 2 * m, 1, 2, 3)
        strata.append({"example": example, "dropout": 0.5, "each rank's seed": list(range(11, 11 + p))})
    return strata


# read by harness/driver/plugin/strata.py: the examples each test runs first, whatever the seed
STRATA = {"test_each_stage_draws_its_masks_once_per_microbatch_in_order": lambda f, p: interleaved_strata(f["target"].max_world_size)}


@pytest.mark.capability("pipeline_dropout")
@given(data=st.data())
def test_each_stage_draws_its_masks_once_per_microbatch_in_order(data, ranks, target, request):
    example = data.draw(examples(target.max_world_size), label="example")
    if target.plan.device_type(example.num_ranks) != "cpu":
        pytest.skip("the masks of a CUDA rank come from its device's generator, which the driver's CPU reference does not replay")
    example = dataclasses.replace(
        example,
        dropout=data.draw(st.sampled_from([0.25, 0.5]), label="dropout"),
        streams=tuple(
            data.draw(
                st.lists(st.integers(0, 2**16), min_size=example.num_ranks, max_size=example.num_ranks, unique=True), label="each rank's seed"
            )
        ),
    )
    judge = Judge(f"{example}", target.reproduce(request.node.nodeid))
    outputs = run_step(judge, ranks, example)
    judge_step(judge, example, outputs, forward_orders=forward_orders(judge, outputs, example.num_microbatches))


def forward_orders(judge: Judge, outputs: dict, m: int) -> list[list[int]]:
    """Each rank's stages in the order it ran their forwards (the harness's record, a runtime's
    warm-up forwards left out), rank by rank; a stage whose forward ran other than m times in the
    call fails here, naming it (one process cannot replay a stream through it; forwards beyond m
    are dropped as a warm-up, so this sees a stage that ran fewer)."""
    orders = []
    for r in range(len(outputs)):
        executed = outputs[r].get("executed")
        if not isinstance(executed, list) or not executed:
            judge.fail(f"rank {r}: the rank program recorded no order of forwards and backwards")
        run = without_warm_up_forwards(calls_of(executed)[0], m)
        order = [int(action[1:]) for action in run if action.startswith("F")]
        for stage in sorted(set(order)):
            if order.count(stage) != m:
                judge.fail(
                    f"rank {r} ran the forward of stage {stage} {order.count(stage)} times in one pipeline_step "
                    f"of {m} microbatches: each microbatch's forward of a stage runs once"
                )
        orders.append(order)
    return orders
