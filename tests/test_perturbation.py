"""--perturb-timing (harness/rank/perturbation.py, harness/driver/perturbation.py): a delayed call's
output holds poison until waited for, the poison names the call, a LONG send reads its buffer when
it leaves, a correct program's results are unchanged, and the schedule is described as drawn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parallelism_conformance.harness.driver import perturbation
from parallelism_conformance.harness.driver.pool import WorldPool
from parallelism_conformance.harness.rank import poison

CALL = "parallelism_conformance.harness.rank.programs.collectives:call"
EARLY = str(Path(__file__).parent / "fixtures" / "early_read_impl.py")


def line_of(text: str) -> str:
    """``early_read_impl.py:N``, N the fixture's line that holds ``text`` (the call a failure names)."""
    lines = Path(EARLY).read_text().splitlines()
    return f"early_read_impl.py:{next(n for n, line in enumerate(lines, 1) if text in line)}"


EVERY_CALL_SHORT, EVERY_CALL_LONG, NONE = ([], 1), ([], 2), ([], 0)


@pytest.fixture(scope="module")
def pool():
    with WorldPool("gloo", timeout_s=10.0, perturb=True) as pool:
        yield pool


def all_reduce(n: int, dtype=torch.float32) -> list[dict]:
    return [{"function": "all_reduce", "arguments": {"tensor": torch.full((4,), r + 1, dtype=dtype), "op": "SUM"}} for r in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_poison_names_its_rank_and_call(dtype):
    tensor = torch.zeros(5, dtype=dtype)
    poison.fill(tensor[1:3], 3, 41)
    named, unnamed = poison.found(tensor * 1 if dtype.is_floating_point else tensor)
    assert named == {(3, 41)} and unnamed == 0
    assert poison.found(torch.arange(5, dtype=dtype)) == (set(), 0)


def test_poison_keeps_the_autograd_version():
    tensor = torch.ones(3)
    before = tensor._version
    poison.fill(tensor, 0, 1)
    poison.copy_back(tensor, torch.zeros(3))
    assert tensor._version == before and tensor.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("schedule", [EVERY_CALL_SHORT, EVERY_CALL_LONG, ([0, 2, 1], 0)])
def test_a_correct_program_is_unchanged(pool, schedule):
    result = pool.run(3, CALL, all_reduce(3), impl="torch.distributed", schedules=[schedule] * 3)
    assert [out["tensor"].tolist() for out in result.outputs] == [[6.0] * 4] * 3
    assert perturbation.poisoned_reads(result.outputs, result.late, [schedule] * 3) is None
    if schedule != ([0, 2, 1], 0):
        assert all(call["state"] == "completed" and call["how"] == "wait()" for table in result.late for call in table)


def test_a_read_before_wait_is_named(pool):
    schedules = [NONE, EVERY_CALL_SHORT]
    result = pool.run(2, CALL, all_reduce(2), impl=EARLY, schedules=schedules)
    message = perturbation.poisoned_reads(result.outputs, result.late, schedules)
    assert message is not None
    assert "rank 1's result holds the poison of rank 1's allreduce (call 0 of the task, delayed short" in message
    assert line_of("work = dist.all_reduce(tensor, op=op") in message and "rank 1: every later call short" in message


def test_an_unperturbed_task_of_a_perturbed_world_is_not_poisoned(pool):
    result = pool.run(2, CALL, all_reduce(2), impl=EARLY, schedules=None)
    assert result.late == [[], []]
    assert perturbation.poisoned_reads(result.outputs, result.late, None) is None


def test_a_long_send_reads_its_buffer_when_it_leaves(pool):
    tasks = [{"function": "send_then_change", "arguments": {"tensor": torch.full((8,), 5.0), "peer": 1 - r}} for r in range(2)]
    result = pool.run(2, CALL, tasks, impl=EARLY, schedules=[EVERY_CALL_LONG, NONE])
    assert result.outputs[1]["tensor"].tolist() == [-1.0] * 8  # what the buffer held when the send left


def test_the_schedule_is_described_per_rank():
    text = perturbation.describe([([0, 2], 0), NONE, EVERY_CALL_SHORT])
    assert text == ("delay schedule rank 0: calls 0-1 none, long, then every later call none; rank 1: none; rank 2: every later call short")


def test_a_failure_that_does_not_repeat_is_reported_as_nondeterminism():
    from types import SimpleNamespace

    from hypothesis.errors import FlakyFailure

    from parallelism_conformance.harness.driver.plugin.nondeterminism import is_flaky, nondeterminism_report
    from parallelism_conformance.harness.driver.plugin.state import Target

    error = FlakyFailure(
        "Hypothesis test_x(data=...) produces unreliable results: Falsified on the first call but did not on a subsequent one",
        [AssertionError("gradient of 'fc2.weight': expected -2.82, got -2.03")],
    )
    item = SimpleNamespace(
        nodeid="conformance/test_data_parallel.py::test_x",
        funcargs={"target": Target("parallelism_conformance.impls", "auto", 4, "ci", perturb="on")},
    )
    assert is_flaky(error)
    text = nondeterminism_report(error, item)
    assert text.startswith("nondeterminism: ") and "FlakyFailure" not in text
    assert "first outcome: AssertionError: gradient of 'fc2.weight': expected -2.82, got -2.03" in text
    assert "replayed: Hypothesis test_x(data=...) produces unreliable results" in text
    assert "--impl parallelism_conformance.impls" in text and "--perturb-timing on" in text


def test_a_buffer_changed_before_its_send_left_is_named(pool):
    tasks = [{"function": "send_then_change", "arguments": {"tensor": torch.full((8,), 5.0), "peer": 1 - r}} for r in range(2)]
    schedules = [EVERY_CALL_LONG, NONE]
    result = pool.run(2, CALL, tasks, impl=EARLY, schedules=schedules)
    message = perturbation.poisoned_reads(result.outputs, result.late, schedules)
    assert "rank 0's send (call 0 of the task, delayed long, made at " in message
    assert line_of("work = dist.isend(tensor, peer)") in message and "had its buffer changed after the call" in message


def test_an_output_written_while_in_flight_is_named(pool):
    tasks = [{"function": "add_while_reducing", "arguments": {"tensor": torch.ones(4)}} for _ in range(2)]
    schedules = [EVERY_CALL_SHORT, NONE]
    result = pool.run(2, CALL, tasks, impl=EARLY, schedules=schedules)
    message = perturbation.poisoned_reads(result.outputs, result.late, schedules)
    assert "rank 0's allreduce (call 0 of the task, delayed short" in message
    assert "had its output written by the program while the call was in flight" in message


def test_a_zero_dimensional_send_is_watched(pool):
    tasks = [{"function": "send_then_change", "arguments": {"tensor": torch.tensor(5.0), "peer": 1 - r}} for r in range(2)]
    result = pool.run(2, CALL, tasks, impl=EARLY, schedules=[EVERY_CALL_LONG, NONE])
    assert result.outputs[1]["tensor"].item() == -1.0


def test_an_accumulation_into_an_output_in_flight_is_named(pool):
    tasks = [{"function": "accumulate_while_reducing", "arguments": {"tensor": torch.ones(4)}} for _ in range(2)]
    schedules = [NONE, EVERY_CALL_LONG]
    result = pool.run(2, CALL, tasks, impl=EARLY, schedules=schedules)
    message = perturbation.poisoned_reads(result.outputs, result.late, schedules)
    assert "rank 1's allreduce (call 0 of the task, delayed long" in message
    assert "had its output written by the program while the call was in flight" in message


def test_a_nan_of_the_data_is_not_poison():
    assert poison.found(torch.tensor([float("nan"), 1.0])) == (set(), 0)
    assert poison.found(torch.tensor([float("nan")], dtype=torch.float64)) == (set(), 0)
