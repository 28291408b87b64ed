"""A test's share of the run's time budget, so that a budget too small for every example of every
test costs examples, spread over the tests, and never whole tests.

Without a share, tests run in order at the profile's full count until the budget is spent, and the
rest are "not run": a correct implementation graded on a slow machine loses their points. With it,
a test that starts when ``L`` seconds are left for ``n`` tests (itself included) may draw examples
for ``L / (n + 1)`` seconds (one share held back): the first example to end past that is its last,
and the test passes on the examples it ran. What a fast test leaves unspent raises the share of
every test after it, since the share is taken again at each test's start.

A share never cuts a test that has failed an example (Hypothesis goes on to shrink it) nor one that
has run fewer than FLOOR examples: an implementation cannot buy itself fewer examples by being slow
(a slow one spends the budget, and its later tests are then not run). Without a budget (the ci
profile) there is no share and every test draws the profile's count.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest

# the examples every test runs before its share can stop it: the brief profile's count, on which
# every correct outsider is judged in the mutation runner
FLOOR = 10


class ShareSpent(pytest.skip.Exception):
    """Raised as an example returns once its test has spent its share; pytest_runtest_makereport
    reports the test passed, with the note (every example it ran passed)."""


@dataclass
class TimeShare:
    """The current test's share of what is left of ``budget`` (plugin/state.py's Budget)."""

    budget: object
    share_s: float = math.inf
    until: float = math.inf
    tests_left: int = 0
    stopped: str = ""  # the note of the current test, once its share stopped it

    def start(self, tests_left: int) -> None:
        """At a test's start, ``tests_left`` counting it."""
        self.stopped = ""
        left = self.budget.left()
        self.tests_left = max(tests_left, 1)
        # one share more than there are tests: the last one is held back, so that an example running past
        # its test's share (a share ends only as an example ends) finds time left, and the last
        # test stops at its share before the budget's end cuts a task
        self.share_s = math.inf if math.isinf(left) else max(left, 0.0) / (self.tests_left + 1)
        self.until = time.monotonic() + self.share_s

    def check(self, passed: int, failed: bool) -> None:
        """After an example returned: stop the test if its share is spent and it passed FLOOR examples
        and failed none. Only there: an example stopped part way, before a draw that an earlier example
        with the same first choices made, reads to Hypothesis as a strategy that drew differently on
        the same data (FlakyStrategyDefinition, a failure); one stopped after it returned drew all it draws."""
        if failed or passed < FLOOR or time.monotonic() < self.until:
            return
        self.stopped = (
            f"{passed} examples ran and passed; drawing stopped at this test's share of the time budget "
            f"({self.share_s:.0f} s, of what was left when it started, for {self.tests_left} tests)"
        )
        raise ShareSpent(self.stopped)
