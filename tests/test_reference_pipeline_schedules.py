"""The pipeline-schedule oracle itself (reference/pipeline_schedules.py and
reference/pipeline_simulator.py), which conformance/test_pipeline_parallel.py's verdicts rely on:
every reference schedule is valid and meets theory, random valid schedules never deadlock, mutated
schedules are rejected with the grid and the bad action, and a deadlocking order is detected."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.pipeline_schedules as sched
from parallelism_conformance.conformance.examples import schedule_shapes as shapes
from parallelism_conformance.reference.pipeline_simulator import Costs, DeadlockError, back_to_back, simulate, steady_period


@given(shape=shapes(8, max_v=3), forward=st.integers(1, 5), backward=st.integers(1, 5))
def test_reference_schedules_are_valid_and_meet_theory(shape, forward, backward):
    kind, p, m, v = shape
    schedule = sched.generate(kind, p, m, v)
    sched.validate(schedule)
    assert sched.Schedule.from_strings(schedule.to_strings(), m, v) == schedule
    result = simulate(schedule, Costs(forward, backward))
    assert result.bubble_fraction == sched.theory_bubble_fraction(kind, p, m, v)
    assert isinstance(result.bubble_fraction, Fraction)
    assert result.makespan == ((v if kind == "interleaved" else 1) * m + p - 1) * (forward + backward)
    assert result.peak_live == [sched.theory_peak_live(kind, p, m, v, r) for r in range(p)]
    if kind == "1f1b":
        assert all(peak <= p - r for r, peak in enumerate(result.peak_live))


@given(shape=shapes(6), seed=st.integers(0, 2**16), split=st.booleans())
def test_random_schedules_are_valid_and_never_deadlock(shape, seed, split):
    _, p, m, v = shape
    schedule = sched.random_schedule(p, m, v, seed, split_backward=split)
    sched.validate(schedule)
    simulate(schedule)


# ---------------------------------------------------------------------- zero bubble (I and W)
@given(p=st.integers(1, 8), data=st.data(), t_f=st.integers(1, 6), t_i=st.integers(1, 6), t_w=st.integers(1, 6))
def test_zb_h1_is_valid_and_reproduces_the_papers_bubble_and_memory(p, data, t_f, t_i, t_w):
    """Qi et al. 2024, section 3.1: with T_W <= T_F and T_W <= T_B (the input-gradient half, I
    here) and m >= p, ZB-H1 idles (p - 1)(T_F + T_B - T_W) per rank and holds 1F1B's peak memory."""
    m = data.draw(st.integers(p, 3 * p), label="m")
    t_w = min(t_w, t_f, t_i)
    schedule = sched.generate("zb-h1", p, m)
    sched.validate(schedule)
    assert sched.Schedule.from_strings(schedule.to_strings(), m) == schedule
    result = simulate(schedule, Costs(t_f, t_i + t_w, weight=t_w))
    assert result.bubble_fraction == sched.theory_bubble_fraction("zb-h1", p, m, t_f=t_f, t_i=t_i, t_w=t_w)
    assert result.makespan == m * (t_f + t_i + t_w) + (p - 1) * (t_f + t_i - t_w)
    assert result.peak_live == [sched.theory_peak_live("zb-h1", p, m, 1, r) for r in range(p)]
    assert max(result.peak_live) == max(simulate(sched.generate("1f1b", p, m)).peak_live)
    one_f_one_b = simulate(sched.generate("1f1b", p, m), Costs(t_f, t_i + t_w)).bubble_fraction
    assert result.bubble_fraction <= one_f_one_b and (p == 1 or result.bubble_fraction < one_f_one_b)


@given(p=st.integers(1, 5), m=st.integers(1, 8))
def test_zb_h1_with_fewer_microbatches_than_ranks_is_still_valid(p, m):
    schedule = sched.generate("zb-h1", p, m)
    sched.validate(schedule)
    assert simulate(schedule).peak_live == [sched.theory_peak_live("zb-h1", p, m, 1, r) for r in range(p)]


@given(p=st.integers(1, 6), m=st.integers(1, 20))
def test_zb_h2_is_valid_and_has_no_bubble_in_steady_state_once_m_reaches_2p_minus_1(p, m):
    """Qi et al. 2024, section 2.2, at their unit costs (F = I = W): ZB-H2 holds up to 2p - 1
    microbatches on every rank and, with steps back to back (no synchronization between them, the
    paper's post-validation), adds exactly its busy time 3m per step once m >= 2p - 1, where ZB-H1
    adds 3m + p - 1; a single step alone still takes ZB-H1's 3m + p - 1 (the last stage cannot
    start before p - 1 forwards have run)."""
    unit = Costs(1, 2, weight=1)
    schedule = sched.generate("zb-h2", p, m)
    sched.validate(schedule)
    assert sched.Schedule.from_strings(schedule.to_strings(), m) == schedule
    result = simulate(schedule, unit)
    assert result.peak_live == [sched.theory_peak_live("zb-h2", p, m, 1, r) for r in range(p)]
    assert steady_period(schedule, unit) == sched.theory_steady_period("zb-h2", p, m)
    if m >= 2 * p - 1:
        assert steady_period(schedule, unit) == 3 * m  # the busy time: no bubble
    if m >= p:
        assert result.makespan == 3 * m + p - 1
        zb_h1 = sched.generate("zb-h1", p, m)
        assert steady_period(zb_h1, unit) == sched.theory_steady_period("zb-h1", p, m)
        assert simulate(zb_h1, unit).makespan == 3 * m + p - 1


@given(p=st.integers(1, 8), m=st.integers(1, 40))
def test_zb_v_meets_the_lower_bound_with_1f1b_memory_once_m_reaches_2p_minus_1(p, m):
    """Qi et al. 2024, section 6, at their unit costs (F = I = W per stage, a stage half a rank's
    layers): ZB-V on the V placement takes 6m + p - 1 for m >= 2p - 1, the least possible (rank
    p - 1 cannot start before p - 1 and has 6m of work): p - 1 idle per rank, half of ZB-H1's
    2(p - 1) in the same units; it holds at most 2p stage activations (1F1B's p microbatches)."""
    unit = Costs(1, 2, weight=1)
    schedule = sched.generate("zb-v", p, m, 2)
    assert schedule.placement == "v" and schedule.stages_of(0) == [0, 2 * p - 1]
    sched.validate(schedule)
    assert sched.Schedule.from_strings(schedule.to_strings(), m, 2, "v") == schedule
    result = simulate(schedule, unit)
    assert result.peak_live == [sched.theory_peak_live("zb-v", p, m, 2, r) for r in range(p)]
    assert max(result.peak_live) <= 2 * p
    if m >= 2 * p - 1:
        assert result.makespan == 6 * m + p - 1
        assert result.bubble_fraction == sched.theory_bubble_fraction("zb-v", p, m, 2)
        zb_h1 = simulate(sched.generate("zb-h1", p, m), Costs(2, 4, weight=2))  # a whole rank's layers
        assert zb_h1.makespan - 6 * m == 2 * (p - 1)


@given(p=st.integers(1, 8), data=st.data())
def test_dualpipe_v_meets_zb_vs_bound_with_one_activation_more(p, data):
    """DualPipeV with its overlapped F&B pairs run in sequence (as torch's runtime runs them on one
    stream), at unit costs: valid on the V, 6m + p - 1 for m >= 2p (ZB-V's lower bound), 2p + 1
    stage activations on every rank; fewer microbatches than stages are refused."""
    m = data.draw(st.integers(2 * p, 6 * p), label="m")
    schedule = sched.generate("dualpipev", p, m, 2)
    assert schedule.placement == "v"
    sched.validate(schedule)
    result = simulate(schedule, Costs(1, 2, weight=1))
    assert result.makespan == 6 * m + p - 1
    assert result.bubble_fraction == sched.theory_bubble_fraction("dualpipev", p, m, 2)
    assert result.peak_live == [sched.theory_peak_live("dualpipev", p, m, 2, r) for r in range(p)] == [2 * p + 1] * p
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        sched.generate("dualpipev", p, 2 * p - 1, 2)


@given(shape=shapes(6, max_v=3), forward=st.integers(1, 5), backward=st.integers(1, 5))
def test_looped_bfs_is_valid_and_meets_its_theory(shape, forward, backward):
    """Looped BFS (Lamy-Poirier 2023): interleaved's bubble (p - 1)/(v m + p - 1) once m >= p, all
    v m chunk activations held; fewer microbatches than ranks leave each further chunk waiting."""
    _, p, m, _ = shape
    v = 1 + shape[3] % 3
    schedule = sched.generate("looped-bfs", p, m, v)
    sched.validate(schedule)
    result = simulate(schedule, Costs(forward, backward))
    assert result.bubble_fraction == sched.theory_bubble_fraction("looped-bfs", p, m, v)
    assert result.makespan == (v * m + p - 1 + (v - 1) * max(0, p - m)) * (forward + backward)
    if m >= p:
        assert result.bubble_fraction == sched.theory_bubble_fraction("interleaved", p, m, v)
    assert result.peak_live == [v * m] * p


@given(p=st.integers(2, 4), m=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_the_validator_knows_the_v_placement(p, m, seed):
    """A random valid schedule on the V placement passes; the same rows read as the loop placement
    break rule 'placement' (rank 0 holds stages 0 and 2p - 1 in the V, 0 and p in the loop); the V
    needs two stages per rank."""
    schedule = sched.random_schedule(p, m, 2, seed, split_backward=bool(seed % 2), placement="v")
    sched.validate(schedule)
    simulate(schedule)
    with pytest.raises(sched.ScheduleError) as error:
        sched.validate(sched.Schedule(p, 2 * p, m, schedule.rows))
    assert error.value.rule == "placement"
    with pytest.raises(sched.ScheduleError, match="two stages per rank") as error:
        sched.validate(sched.Schedule(p, 3 * p, m, schedule.rows, "v"))
    with pytest.raises(ValueError, match="must be 2"):
        sched.generate("zb-v", p, m, 1)


def test_an_input_pass_can_be_timed_apart_from_a_whole_backward():
    """Costs.input: DualPipeV mixes whole backwards with split ones; a runtime that walks the graph
    twice makes I + W dearer than B, which the default (I = B - W) would hide."""
    schedule = sched.generate("dualpipev", 1, 2, 2)
    kinds = {a.kind for a in schedule.rows[0]}
    assert {sched.B, sched.I, sched.W} <= kinds
    default = simulate(schedule, Costs(1, 2, weight=2))  # I costs 2 - 2 = 0
    timed = simulate(schedule, Costs(1, 2, weight=2, input=2))
    splits = sum(a.kind == sched.I for a in schedule.rows[0])
    assert timed.makespan - default.makespan == 2 * splits


def test_steps_back_to_back_renumber_microbatches_and_keep_each_ranks_order():
    schedule = sched.generate("1f1b", 2, 2)
    twice = back_to_back(schedule, 2)
    sched.validate(twice)
    assert twice.num_microbatches == 4
    assert [str(a) for a in twice.rows[0]][: len(schedule.rows[0])] == [str(a) for a in schedule.rows[0]]
    assert [a.microbatch for a in twice.rows[0][len(schedule.rows[0]) :] if a.kind == sched.F] == [2, 3]
    with pytest.raises(ValueError, match="iterations must be at least 1"):
        back_to_back(schedule, 0)


@given(p=st.integers(2, 4), data=st.data())
def test_the_validator_knows_the_rules_of_a_split_backward(p, data):
    m = data.draw(st.integers(1, 5), label="m")
    schedule = sched.generate("zb-h1", p, m)
    rows = _rows(schedule)
    r = data.draw(st.integers(0, p - 1), label="rank")
    i = data.draw(st.integers(0, m - 1), label="microbatch")
    weight, grad = sched.Action(r, sched.W, i), sched.Action(r, sched.I, i)
    broken = data.draw(st.sampled_from(["W before I", "no W", "B and I", "no I"]), label="broken")
    if broken == "W before I":
        rows[r].remove(weight)
        rows[r].insert(rows[r].index(grad), weight)
        rule = "weight after input"
    elif broken == "no W":
        rows[r].remove(weight)
        rule = "exactly once"
    elif broken == "B and I":
        rows[r].append(sched.Action(r, sched.B, i))
        rule = "exactly once"
    else:
        rows[r][rows[r].index(grad)] = sched.Action(r, sched.F, i)  # also a duplicate forward
        rule = "exactly once"
    error = _rejected(schedule, rows)
    assert error.rule == rule and (error.action.stage, error.action.microbatch) == (r, i)


def _rows(schedule):
    return [list(row) for row in schedule.rows]


def _rejected(schedule, rows) -> sched.ScheduleError:
    with pytest.raises(sched.ScheduleError) as caught:
        sched.validate(schedule.with_rows(rows))
    message = str(caught.value)
    assert "rank 0 |" in message and "step" in message, f"no grid in:\n{message}"
    assert caught.value.rule in message
    return caught.value


@given(shape=shapes(4), data=st.data())
def test_the_validator_rejects_a_dropped_action(shape, data):
    kind, p, m, v = shape
    schedule = sched.generate(kind, p, m, v)
    rows = _rows(schedule)
    r = data.draw(st.integers(0, p - 1), label="rank")
    dropped = rows[r].pop(data.draw(st.integers(0, len(rows[r]) - 1), label="step"))
    error = _rejected(schedule, rows)
    assert str(dropped) in str(error)


@given(shape=shapes(4), data=st.data())
def test_the_validator_rejects_a_backward_before_its_forward(shape, data):
    kind, p, m, v = shape
    schedule = sched.generate(kind, p, m, v)
    rows = _rows(schedule)
    stage = data.draw(st.integers(0, p * v - 1), label="stage")
    i = data.draw(st.integers(0, m - 1), label="microbatch")
    r = schedule.rank_of(stage)
    backward = sched.Action(stage, sched.B, i)
    rows[r].remove(backward)
    rows[r].insert(rows[r].index(sched.Action(stage, sched.F, i)), backward)
    error = _rejected(schedule, rows)
    assert (error.rule, error.rank, error.action) == ("backward after forward", r, backward)
    assert error.step == rows[r].index(backward) and f"[{backward}]" in str(error)


@given(shape=shapes(4), data=st.data())
def test_the_validator_rejects_a_send_without_its_receive(shape, data):
    kind, p, m, v = shape
    if p == 1:
        return  # nothing is sent
    schedule = sched.generate(kind, p, m, v)
    rows = _rows(schedule)
    receives = [(r, a) for r, row in enumerate(rows) for a in row if a.kind in (sched.RECV_F, sched.RECV_B)]
    r, receive = data.draw(st.sampled_from(receives), label="dropped receive")
    rows[r].remove(receive)
    message = str(_rejected(schedule, rows))
    send = receive.matching()
    assert str(send) in message and "never received" in message


@given(shape=shapes(4), data=st.data())
def test_a_deadlocking_order_is_detected(shape, data):
    """A rank holds the activations of microbatch i until their gradient comes back (SEND_F moved
    after the RECV_B that answers it): valid action by action, but a wait-for cycle."""
    kind, p, m, v = shape
    if p == 1:
        return
    schedule = sched.generate(kind, p, m, v)
    rows = _rows(schedule)
    sends = [(r, a) for r, row in enumerate(rows) for a in row if a.kind == sched.SEND_F]
    r, send = data.draw(st.sampled_from(sends), label="delayed send")
    answer = sched.Action(send.stage, sched.RECV_B, send.microbatch)
    rows[r].remove(send)
    rows[r].insert(rows[r].index(answer) + 1, send)
    stalled = schedule.with_rows(rows)
    sched.validate(stalled)
    with pytest.raises(DeadlockError) as caught:
        simulate(stalled)
    error = caught.value
    assert error.cycle and r in error.stuck
    message = str(error)
    assert "deadlock" in message and "rank 0 |" in message and "wait-for cycle" in message
    for rank, (step, action) in error.stuck.items():
        assert f"rank {rank} waits at step {step} in {action}" in message


def test_interleaved_reference_refuses_m_not_a_multiple_of_p():
    with pytest.raises(ValueError, match=r"multiple of the number of ranks: m=6 is not a multiple of p=4"):
        sched.generate("interleaved", 4, 6, 2)
