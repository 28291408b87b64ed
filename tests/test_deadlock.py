"""A hang known at once (harness/driver/deadlock.py): the verdict on synthetic samples, each way a
world can look deadlocked without being so, the flight recorder's activity words, and worlds that
deadlock, skip a collective, compute forever or merely start late, end to end.

No assertion on elapsed time but generous upper guards: what is asserted is the event (the summary
says "deadlock", or the deadline's words where no deadlock may be called)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from parallelism_conformance.harness.driver import deadlock
from parallelism_conformance.harness.driver.deadlock import Deadlock, RankSample, Sample, describe, verdict
from parallelism_conformance.harness.driver.disagreement import Call
from parallelism_conformance.harness.driver.failures import RanksCrashed, RanksDeadlocked, RanksHung
from parallelism_conformance.harness.driver.pool import WorldPool
from parallelism_conformance.harness.rank.flight_recorder import Recorder

FIXTURES = Path(__file__).parent / "fixtures"
CALL = "parallelism_conformance.harness.rank.programs.collectives:call"
TASK = 7
DEADLINE_S = 60.0  # the default --rank-timeout: a deadlock must be reported long before it


# ------------------------------------------------------------------------- synthetic samples
def rank(r: int, *, replied=False, task=TASK, waiting=1, io=1000, cpu=50, busy=False) -> RankSample:
    return RankSample(r, replied, task, waiting, io, cpu, busy)


def series(*ranks_per_sample, interval=0.2) -> list[Sample]:
    """Samples taken every ``interval`` s; each argument is one sample's ranks."""
    return [Sample(10.0 + i * interval, tuple(ranks)) for i, ranks in enumerate(ranks_per_sample)]


def still(*ranks: RankSample, samples=3) -> list[Sample]:
    return series(*[ranks] * samples)


def test_every_rank_waiting_and_nothing_moving_is_a_deadlock():
    found = verdict(still(rank(0), rank(1), rank(2)), TASK)
    assert found == Deadlock(waiting=(0, 1, 2), replied=(), still_s=pytest.approx(0.4))


def test_ranks_that_replied_and_are_idle_do_not_prevent_the_verdict():
    found = verdict(still(rank(0, replied=True, waiting=0), rank(1), rank(2)), TASK)
    assert found is not None and found.waiting == (1, 2) and found.replied == (0,)


def test_two_samples_or_a_short_stillness_are_not_enough():
    assert verdict(still(rank(0), rank(1), samples=2), TASK) is None
    assert verdict(series(*[[rank(0), rank(1)]] * 3, interval=0.1), TASK) is None  # 0.2 s still
    assert verdict(series(*[[rank(0), rank(1)]] * 5, interval=0.1), TASK) is not None  # 0.4 s, 5 samples


def test_a_rank_between_calls_is_not_blocked():
    """A long computation, a sleep or a call the recorder does not see: no call in flight."""
    assert verdict(still(rank(0), rank(1, waiting=0)), TASK) is None


def test_a_rank_that_has_not_begun_the_task_is_not_blocked():
    """Its flight recorder still shows the last task, whose waits are no evidence for this one."""
    assert verdict(still(rank(0), rank(1, task=TASK - 1)), TASK) is None


def test_a_slow_transfer_that_moves_bytes_is_not_a_deadlock():
    moving = series(*[[rank(0, io=1000 + 4096 * i), rank(1, io=2000 + 4096 * i)] for i in range(8)])
    assert verdict(moving, TASK) is None
    one_byte = series([rank(0), rank(1)], [rank(0), rank(1, io=1001)], [rank(0), rank(1, io=1001)])
    assert verdict(one_byte, TASK) is None


def test_stillness_is_measured_from_the_last_byte_that_moved():
    samples = series([rank(0, io=1), rank(1)], [rank(0, io=2), rank(1)], [rank(0, io=2), rank(1)])
    assert verdict(samples, TASK) is None  # still since the second sample only
    samples = series([rank(0, io=1), rank(1)], *[[rank(0, io=2), rank(1)]] * 3)
    assert verdict(samples, TASK).still_s == pytest.approx(0.4)


def test_a_pure_cpu_operation_inside_a_call_is_not_a_deadlock():
    """gloo reducing a large tensor: the rank is in the call, no byte moves, but CPU time rises."""
    computing = series(*[[rank(0), rank(1, cpu=50 + 15 * i)] for i in range(6)])
    assert verdict(computing, TASK) is None


def test_cpu_time_within_the_noise_is_still():
    """A waiting rank's watchdog thread wakes twice a second: a tick now and then is not work."""
    ticking = series(*[[rank(0, cpu=50 + i), rank(1, cpu=80 + 2 * i)] for i in range(4)])
    assert verdict(ticking, TASK) is not None
    assert verdict(series(*[[rank(0), rank(1, cpu=80 + 3 * i)] for i in range(4)]), TASK) is None


def test_a_runnable_thread_is_not_still():
    """A loaded machine: a rank waiting for a core moves nothing, but it would if it ran."""
    assert verdict(still(rank(0), rank(1, busy=True)), TASK) is None


def test_counters_that_cannot_be_read_give_no_verdict():
    """A contained rank's /proc/<pid>/io refuses a driver without CAP_SYS_PTRACE: the deadline judges."""
    assert verdict(still(rank(0), rank(1, io=None)), TASK) is None
    assert verdict(still(rank(0), rank(1, cpu=None, busy=None)), TASK) is None
    assert verdict(still(rank(0), rank(1, task=None, waiting=None)), TASK) is None  # no flight recorder


def test_a_replied_rank_whose_thread_still_works_prevents_the_verdict():
    samples = series(*[[rank(0, replied=True, waiting=0, io=5 + i), rank(1)] for i in range(5)])
    assert verdict(samples, TASK) is None


def test_a_rank_that_replies_breaks_the_stillness():
    samples = series([rank(0), rank(1)], [rank(0), rank(1)], [rank(0, replied=True, waiting=0), rank(1)])
    assert verdict(samples, TASK) is None


def test_no_verdict_once_every_rank_replied():
    assert verdict(still(rank(0, replied=True, waiting=0), rank(1, replied=True, waiting=0)), TASK) is None


def test_the_description_names_each_rank_and_its_call():
    def call(r, op, peer=None):
        return Call(r, 1, op, "posted", "float32", (4,), peer, None, 0, 1, (0, 1, 2), 4, 16, "impl.py:3")

    text = describe(Deadlock((0, 1, 2), (), 0.61), {0: call(0, "recv", 2), 1: call(1, "send", 2), 2: call(2, "recv")})
    assert text == (
        "deadlock: every rank is waiting (rank 0 in recv from 2; rank 1 in send to 2; rank 2 in recv from any) and no byte moved for 0.6 s"
    )
    text = describe(Deadlock((1, 2), (0,), 0.4), {1: call(1, "all_reduce"), 2: call(2, "all_reduce")})
    assert text == "deadlock: every rank is waiting (ranks 1, 2 in all_reduce; rank 0 returned its result) and no byte moved for 0.4 s"
    assert "rank 1 in a communication call" in describe(Deadlock((1,), (0, 2), 0.5), {})
    assert "ranks 0, 2 returned their results" in describe(Deadlock((1,), (0, 2), 0.5), {})


# ----------------------------------------------------------------------------------- the readers
def test_the_flight_recorder_header_says_which_task_runs_and_how_many_threads_wait(tmp_path):
    ring = str(tmp_path / "world-rank0.ring")
    recorder = Recorder(ring, 0)
    recorder.begin_task(3)
    assert deadlock.read_activity(ring) == (3, 0)
    recorder.enter()
    recorder.enter()
    assert deadlock.read_activity(ring) == (3, 2)
    recorder.leave()
    recorder.pause(4)  # the harness's own probe: not recorded, still watched
    assert deadlock.read_activity(ring) == (4, 1)
    recorder.leave()
    assert deadlock.read_activity(ring) == (4, 0)
    assert deadlock.read_activity(str(tmp_path / "absent.ring")) is None


def test_the_kernel_counters_of_a_live_process_are_read_and_a_gone_one_is_unknown():
    io, (cpu, busy) = deadlock.read_io(os.getpid()), deadlock.read_cpu(os.getpid())
    assert io > 0 and cpu >= 0 and busy  # this thread is running while it reads
    assert deadlock.read_io(2**22 + 1) is None and deadlock.read_cpu(2**22 + 1) is None


# ------------------------------------------------------------------------------------ end to end
def all_reduce_task(n: int) -> list[dict]:
    return [{"function": "all_reduce", "arguments": {"tensor": torch.full((4,), float(r + 1)), "op": "SUM"}, "group": None} for r in range(n)]


def fixture_impl(name: str) -> str:
    return str(FIXTURES / f"{name}.py")


@pytest.fixture(scope="module")
def pool():
    with WorldPool("gloo", timeout_s=DEADLINE_S) as pool:
        yield pool


def deadlock_report(pool, n: int, fixture: str) -> str:
    started = time.monotonic()
    with pytest.raises(RanksDeadlocked) as caught:
        pool.run(n, CALL, all_reduce_task(n), impl=fixture_impl(fixture))
    assert time.monotonic() - started < DEADLINE_S  # an upper guard only: the event is the verdict
    return str(caught.value)


def test_a_ring_where_every_rank_receives_first_is_a_deadlock_with_the_deadlines_report(pool):
    text = deadlock_report(pool, 3, "ring_recv_deadlock_impl")
    first = text.splitlines()[0]
    assert (
        "deadlock: every rank is waiting (rank 0 in recv from 2; rank 1 in recv from 0; rank 2 in recv from 1) and no byte moved for"
    ) in first
    assert "deadline" not in first
    assert "all wait to receive from each other" in first  # the first disagreement, as after a deadline
    assert all(f"rank {r} hung" in text for r in range(3))
    assert "ring_recv_deadlock_impl.py" in text and "distributed_c10d.py" in text  # every rank's stack
    assert pool.run(3, CALL, all_reduce_task(3), impl="torch.distributed").outputs[0]["tensor"][0] == 6.0


def test_a_collective_one_rank_skips_is_a_deadlock(pool):
    first = deadlock_report(pool, 3, "skipped_collective_impl").splitlines()[0]
    assert "deadlock: every rank is waiting (ranks 1, 2 in all_reduce; rank 0 returned its result)" in first
    assert "rank 0 never called the all_reduce" in first


def test_a_stray_message_check_that_hangs_is_a_deadlock_too(pool):
    """The harness's own probe after the task: its calls are not recorded, its waits are watched."""
    started = time.monotonic()
    with pytest.raises(RanksCrashed, match="stray-message check after it failed") as caught:
        pool.run(2, CALL, all_reduce_task(2), impl=fixture_impl("leftover_recv_impl"))
    assert time.monotonic() - started < DEADLINE_S
    assert "stray_messages on 2 ranks: deadlock: every rank is waiting (rank 1 in a communication call; rank 0 returned its result)" in str(
        caught.value
    )


def test_a_rank_that_starts_late_is_not_a_deadlock(pool):
    """Rank 1 spends 1.5 s outside any call while rank 0 already waits in the all_reduce."""
    result = pool.run(2, CALL, all_reduce_task(2), impl=fixture_impl("slow_start_impl"))
    assert [out["tensor"].tolist() for out in result.outputs] == [[3.0] * 4] * 2


def test_a_rank_that_computes_forever_is_left_to_the_deadline(pool):
    with pytest.raises(RanksHung) as caught:
        pool.run(2, CALL, all_reduce_task(2), impl=fixture_impl("busy_loop_impl"), timeout_s=3.0)
    assert not isinstance(caught.value, RanksDeadlocked)
    first = str(caught.value).splitlines()[0]
    assert "no result within the 3 s deadline" in first and "deadlock" not in first
    assert "busy_loop_impl.py" in str(caught.value)  # its stack points at the loop
