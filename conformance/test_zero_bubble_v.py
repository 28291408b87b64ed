"""Conformance of the V-shaped zero-bubble pipeline (capability ``zero_bubble_v``): ZB-V, Qi et al.,
"Zero Bubble Pipeline Parallelism" (ICLR 2024), section 6, as torch.distributed.pipelining ships it
(``ScheduleZBVZeroBubble``). Two stages per rank on the V placement: rank r holds stages r and
2p - 1 - r, so rank 0 holds the first stage and the last (it gets the inputs and the targets and
returns the loss) and the activations go down the ranks and back up.

On the ranks (conformance/test_pipeline_parallel.py's helpers): ``pipeline_step(..., schedule="zb-v")``
and random valid split schedules on the V passed as a callable with ``placement="v"``; the loss
and every gradient against the dense model, and the schedule asked for is the schedule run: a
callable's compute order exactly, and for "zb-v" the order of the implementation's own
``generate_schedule("zb-v", p, m, 2)`` (whose rows the driver validates first).

Graded schedules: ``generate_schedule("zb-v", p, m, 2)`` must pass the reference validator on the
V placement, run without deadlock, hold at most 2p stage activations per rank (1F1B's p
microbatches: a stage is half a rank's layers), and for m >= 2p - 1 at the paper's unit costs
(F = I = W per stage) take exactly 6m + p - 1, the least any schedule can (rank p - 1 cannot start
before p - 1 forwards have run and has 6m of work): p - 1 idle per rank, half ZB-H1's. Any other
stages_per_rank is refused with a ValueError.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import parallelism_conformance.reference.pipeline_schedules as sched
from parallelism_conformance.conformance.test_pipeline_parallel import (
    Example,
    check_drawn_step,
    examples,
    graded_schedule,
    judge_step,
    run_step,
)
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.reference.pipeline_simulator import Costs, simulate

pytestmark = pytest.mark.capability("zero_bubble_v")

UNIT = Costs(forward=1, backward=2, weight=1)  # F = I = W = 1 per stage, the paper's assumption


def generated_zb_v(judge: Judge, ranks, p: int, m: int) -> sched.Schedule:
    """The implementation's generate_schedule("zb-v", p, m, 2), read on the V placement and
    validated (a failure names the broken rule, with the grid)."""
    out = graded_schedule(judge, ranks, "zb-v", p, m, 2)
    if "rows" not in out:
        judge.fail(f"generate_schedule('zb-v', {p}, {m}, 2) refused valid arguments: {out.get('refused')}")
    try:
        schedule = sched.Schedule.from_strings(out["rows"], m, 2, sched.V_SHAPE)
        if schedule.num_ranks != p:
            judge.fail(f"generate_schedule returned {schedule.num_ranks} rows for {p} ranks")
        sched.validate(schedule)
    except ValueError as error:  # ScheduleError included
        judge.fail(f"the generated ZB-V schedule is not valid on the V placement (rank r holds stages r and 2p - 1 - r): {error}")
    return schedule


@given(data=st.data())
def test_zb_v_step_matches_the_dense_model_and_runs_its_own_schedule(data, ranks, target, reproduce):
    example: Example = data.draw(examples(target.max_world_size, kinds=sched.V_SHAPE_KINDS), label="example")
    event(f"zb-v, p={example.num_ranks}")
    judge = Judge(str(example), reproduce)
    order = generated_zb_v(judge, ranks, example.num_ranks, example.num_microbatches).compute_only()
    judge_step(judge, example, run_step(judge, ranks, example), order)


@given(data=st.data())
def test_any_valid_schedule_on_the_v_runs_and_matches_the_dense_model(data, ranks, target, request):
    """A random valid schedule on the V placement, backward split into I and W, as a callable."""
    check_drawn_step(data, ranks, target, request, kinds=("random-v",))


@given(data=st.data())
def test_dualpipe_v_runs_and_matches_the_dense_model(data, ranks, target, request):
    """DualPipeV (its overlapped F&B pairs in sequence; the reference's rows, torch's order), as a
    callable on the V, run in its order."""
    check_drawn_step(data, ranks, target, request, kinds=("dualpipev",))


@given(data=st.data())
def test_unequal_microbatches_under_zb_v_match_the_dense_model(data, ranks, target, request):
    check_drawn_step(data, ranks, target, request, kinds=("random-v",), unequal=True)


@given(data=st.data())
def test_generated_zb_v_is_valid_and_meets_the_lower_bound(data, ranks, reproduce):
    p = data.draw(st.integers(1, 8), label="p")
    m = data.draw(st.integers(1, 24), label="m")
    judge = Judge(f"generate_schedule('zb-v', num_ranks={p}, num_microbatches={m}, stages_per_rank=2)", reproduce)
    schedule = generated_zb_v(judge, ranks, p, m)
    if not any(a.kind == sched.W for row in schedule.rows for a in row):
        judge.fail(
            "ZB-V splits every backward into I and W; the generated schedule has no W:\n" + sched.render_grid(schedule, compute_only=True)
        )
    try:
        result = simulate(schedule, UNIT)
    except sched.ScheduleError as error:  # DeadlockError included
        judge.fail(f"the generated schedule: {error}")
    if max(result.peak_live) > 2 * p:
        judge.fail(
            f"peak live stage activations per rank (released at W) {result.peak_live}: ZB-V holds at most 2p "
            f"= {2 * p} (1F1B's p microbatches, a stage being half a rank's layers)\n"
            f"{sched.render_grid(schedule, compute_only=True)}"
        )
    if m >= 2 * p - 1 and result.makespan != 6 * m + p - 1:
        judge.fail(
            f"at unit costs (F = I = W = 1 per stage) the step takes {result.makespan}; ZB-V takes "
            f"6m + p - 1 = {6 * m + p - 1} for m >= 2p - 1, the least possible (bubble "
            f"{sched.theory_bubble_fraction('zb-v', p, m, 2)}, simulated {result.bubble_fraction})\n"
            f"{result.render()}\n\n{sched.render_grid(schedule, compute_only=True)}"
        )


@given(p=st.integers(1, 8), m=st.integers(1, 8), v=st.sampled_from([1, 3, 4]))
def test_zb_v_refuses_other_than_two_stages_per_rank(p, m, v, ranks, reproduce):
    judge = Judge(f"generate_schedule('zb-v', num_ranks={p}, num_microbatches={m}, stages_per_rank={v})", reproduce)
    out = graded_schedule(judge, ranks, "zb-v", p, m, v)
    if "refused" not in out:
        judge.fail(f"ZB-V places two stages per rank; stages_per_rank={v} must raise a ValueError, it returned a schedule")
