"""Conformance of zero-bubble pipeline parallelism (capability ``zero_bubble``): ``pipeline_step``
running schedules whose backward is split into I (the input's gradient, on the critical path) and W
(the weights' gradient, deferred into the bubbles), after Qi et al., "Zero Bubble Pipeline
Parallelism" (ICLR 2024), and ``generate_schedule("zb-h1", ...)``.

On the ranks, as for the classic schedules (conformance/test_pipeline_parallel.py, whose helpers
this file uses): the loss and every gradient against the dense model, and the schedule asked for is
the schedule run. A split backward changes what the hooks on the stage modules see: a forward, and
the moment a stage's parameter gradients are accumulated (the W; an I accumulates none), so a
runtime that runs each backward whole where the I is, or its W right after its I, shows in the
order, though every number is right. ZB-H1's order is required exactly: it is the schedule.

Graded schedules: generate_schedule("zb-h1", p, m) must pass the reference validator (which knows
the split: exactly one B or one I and one W per stage and microbatch, every W after its I, a
stage's input gradient from its successor's B or I), run without deadlock, and reproduce the
paper's figures in the simulator, exactly (Fractions), with T_W <= T_F, T_W <= T_I and m >= p:
bubble (p - 1)(T_F + T_I - T_W) per rank, 1F1B's peak memory min(m, p) activations on every rank.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.pipeline_schedules as sched
from parallelism_conformance.conformance.test_pipeline_parallel import check_drawn_step, graded_schedule
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.reference.pipeline_simulator import Costs, simulate

pytestmark = pytest.mark.capability("zero_bubble")


@given(data=st.data())
def test_zb_h1_step_matches_the_dense_model_and_runs_the_schedule(data, ranks, target, request):
    check_drawn_step(data, ranks, target, request, kinds=sched.ZERO_BUBBLE_KINDS)


@given(data=st.data())
def test_any_valid_split_schedule_runs_and_matches_the_dense_model(data, ranks, target, request):
    """A random valid schedule with every backward split into an I and a W placed anywhere after
    it (v stages per rank too), passed as a callable schedule."""
    check_drawn_step(data, ranks, target, request, kinds=("random-split",))


@given(data=st.data())
def test_zb_h2_runs_and_matches_the_dense_model(data, ranks, target, request):
    """ZB-H2 (2p - 1 microbatches in flight, Qi et al. 2024 sec. 2.2), the reference's rows passed
    as a callable schedule, run in their order."""
    check_drawn_step(data, ranks, target, request, kinds=("zb-h2",))


@given(data=st.data())
def test_unequal_microbatches_under_zb_h1_match_the_dense_model(data, ranks, target, request):
    check_drawn_step(data, ranks, target, request, kinds=sched.ZERO_BUBBLE_KINDS, unequal=True)


ZB_COSTS = (
    Costs(forward=1, backward=2, weight=1),
    Costs(forward=2, backward=3, weight=1),
    Costs(forward=3, backward=5, weight=2),
)  # T_W <= T_F and T_W <= T_I in each


@given(data=st.data())
def test_generated_zb_h1_is_valid_and_reproduces_the_paper(data, ranks, reproduce):
    p = data.draw(st.integers(1, 8), label="p")
    m = data.draw(st.integers(1, 16), label="m")
    judge = Judge(f"generate_schedule('zb-h1', num_ranks={p}, num_microbatches={m}, stages_per_rank=1)", reproduce)
    out = graded_schedule(judge, ranks, "zb-h1", p, m, 1)
    if "rows" not in out:
        judge.fail(f"generate_schedule refused valid arguments: {out.get('refused')}")
    try:
        schedule = sched.Schedule.from_strings(out["rows"], m, 1)
        if schedule.num_ranks != p:
            judge.fail(f"generate_schedule returned {schedule.num_ranks} rows for {p} ranks")
        sched.validate(schedule)
    except ValueError as error:  # ScheduleError included
        judge.fail(f"the generated schedule is not valid: {error}")
    if not any(a.kind == sched.W for row in schedule.rows for a in row):
        judge.fail(
            "ZB-H1 splits every backward into I and W; the generated schedule has no W:\n" + sched.render_grid(schedule, compute_only=True)
        )
    for costs in ZB_COSTS:
        try:
            result = simulate(schedule, costs)
        except sched.ScheduleError as error:  # DeadlockError included
            judge.fail(f"the generated schedule: {error}")
        t_f, t_w = costs.forward, costs.weight
        if m >= p:
            bubble = sched.theory_bubble_fraction("zb-h1", p, m, t_f=t_f, t_i=costs.backward - t_w, t_w=t_w)
            if result.bubble_fraction != bubble:
                judge.fail(
                    f"with T_F={t_f}, T_I={costs.backward - t_w}, T_W={t_w} the simulated bubble fraction is "
                    f"{result.bubble_fraction} (makespan {result.makespan}); ZB-H1's is {bubble} = (p - 1)"
                    f"(T_F + T_I - T_W) per rank (Qi et al. 2024)\n{result.render()}\n\n"
                    f"{sched.render_grid(schedule, compute_only=True)}"
                )
    peaks = [sched.theory_peak_live("zb-h1", p, m, 1, r) for r in range(p)]
    if result.peak_live != peaks:
        judge.fail(
            f"peak live activations per rank (released at W) {result.peak_live}; ZB-H1 holds {peaks}, "
            f"1F1B's largest, on every rank\n{sched.render_grid(schedule, compute_only=True)}"
        )
