"""A budget too small for every example of every test costs examples, spread over the tests, never
whole tests (harness/driver/plugin/time_share.py); a failure is never cut short."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism_conformance.harness.driver.plugin.refusals import Refusals
from parallelism_conformance.harness.driver.plugin.time_share import FLOOR, ShareSpent, TimeShare

FIXTURES = Path(__file__).parent / "fixtures"


class FixedBudget:
    def __init__(self, left: float):
        self._left = left

    def left(self) -> float:
        return self._left


def test_the_share_is_what_is_left_over_the_tests_left_and_one_held_back():
    share = TimeShare(FixedBudget(120.0))
    share.start(tests_left=39)
    assert share.share_s == pytest.approx(3.0)
    share.start(tests_left=0)  # the last test, counted once whatever the caller says
    assert share.share_s == pytest.approx(60.0)


def test_without_a_budget_nothing_is_cut():
    share = TimeShare(FixedBudget(math.inf))
    share.start(tests_left=3)
    share.check(passed=10_000, failed=False)
    assert share.stopped == ""


def test_a_spent_share_stops_only_a_test_that_ran_its_floor_and_failed_nothing():
    share = TimeShare(FixedBudget(0.0))
    share.start(tests_left=5)
    time.sleep(0.01)
    share.check(passed=FLOOR - 1, failed=False)  # below the floor: goes on
    share.check(passed=FLOOR + 5, failed=True)  # a failure: Hypothesis shrinks it, whatever the time
    assert share.stopped == ""
    with pytest.raises(ShareSpent, match=f"{FLOOR} examples ran and passed; drawing stopped"):
        share.check(passed=FLOOR, failed=False)


def test_a_stop_comes_after_an_example_returned_never_part_way():
    """Examples that share their first choices and draw more after them: a stop part way (before the
    second draw) reads to Hypothesis as a strategy that drew less on the same data, a failure
    (FlakyStrategyDefinition, as a grading run once saw it); a stop after an example returned does not."""
    share, refusals = TimeShare(FixedBudget(0.0)), Refusals()
    share.start(tests_left=1)

    @settings(max_examples=200, derandomize=True, database=None)
    @given(st.data())
    def drawn_in_two_parts(data):
        data.draw(st.integers(0, 1))  # two first choices: later examples repeat an earlier one's
        data.draw(st.integers(0, 1000))

    refusals.watch_failures(drawn_in_two_parts, after_passed=share.check)
    with pytest.raises(ShareSpent):
        drawn_in_two_parts()
    assert refusals.passed == FLOOR


@pytest.fixture
def graded(suite_runner, tmp_path):
    def run(
        impl: str,
        budget_s: float,
        profile: str = "grading",
        tests: str = "test_training_matches_one_process_on_the_global_batch or test_buffers_start_from_rank_0s",
        *options: str,
    ):
        result = suite_runner.run(
            "conformance/test_data_parallel.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "--impl",
            impl,
            f"--hypothesis-profile={profile}",
            "--contain-ranks",
            "no",
            "--time-budget",
            str(budget_s),
            "--report-dir",
            str(tmp_path),
            "-k",
            tests,
            *options,
        )
        tests = json.loads((tmp_path / "results.json").read_text())["tests"]
        return result, {t["name"]: t for t in tests}

    return run


def test_a_budget_too_small_for_every_example_cuts_examples_not_tests(graded):
    # thorough: 150 examples a test, well past a share of 8 s on a machine several times this one's speed
    result, tests = graded("parallelism_conformance.impls", 24, "thorough")
    assert result.returncode == 0, result.stdout[-3000:]
    assert tests and all(t["status"] == "passed" and t["score"] == t["max_score"] for t in tests.values()), tests
    cut = [t for t in tests.values() if "drawing stopped at this test's share of the time budget" in t["output"]]
    assert cut, f"no test was cut at its share: {tests}"


def test_a_failing_test_is_not_cut_into_a_pass(graded):
    # every example fails (rank 0's state is never broadcast): past its share, shrinking goes on
    # worlds of 2 and a share of 3 s: shrinking still outlasts the share, and takes a third of the time
    started = time.monotonic()
    result, tests = graded("mutants/data_parallel/no_broadcast.py", 6, "grading", "test_buffers_start_from_rank_0s", "--max-world-size", "2")
    assert result.returncode == 1, result.stdout[-3000:]
    assert tests["test_buffers_start_from_rank_0s"]["status"] == "failed", tests
    assert "share of the time budget" not in tests["test_buffers_start_from_rank_0s"]["output"], tests
    assert time.monotonic() - started > 6 / 2  # the run (its one test, mostly) outlasted the test's share
