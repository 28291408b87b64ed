"""What cannot run is rejected, not failed: examples the project's own adapters say torch's library
cannot run (Refusals) and cases the backend's own collectives refuse (BackendRefusals)."""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import NoReturn

import pytest
from hypothesis import currently_in_test_context, reject
from hypothesis.errors import HypothesisException


class EnoughRefused(pytest.skip.Exception):
    """Raised by Refusals.refuse when a test that ran examples has had REFUSAL_BUDGET refused: it
    stops drawing (each refusal is a task on the ranks), and pytest_runtest_makereport reports it
    as passed with a note."""


@dataclass
class Refusals:
    """What the project's own adapters said torch's library cannot run, in the current test
    (conformance.verdict.run_or_skip): such an example is rejected and Hypothesis draws another.
    A test none of whose first REFUSALS_BEFORE_SKIP examples ran is skipped with the reasons; one
    that ran some stops drawing at REFUSAL_BUDGET refusals, and passes with a note of what it ran
    and what it did not."""

    REFUSALS_BEFORE_SKIP = 10
    # torch's runtime refuses 150-204 random pipeline orders for every 25 it runs (measured); 50
    # refusals let 9-17 run, at a quarter of the tasks of drawing until 25 ran
    REFUSAL_BUDGET = 50

    reasons: Counter = field(default_factory=Counter)  # reason without its particulars -> count
    first: dict = field(default_factory=dict)  # reason without its particulars -> the first one said
    # the examples (by their Judge, one per example; held, so that no id is reused) that ran a task,
    # and those refused: an example that generated its schedule and was refused its step did not run
    _ran: dict = field(default_factory=dict)
    _refused: dict = field(default_factory=dict)
    # an example of this test failed (watch_failures): from then on refusals only reject, so that
    # neither a skip nor a stop can end the test while Hypothesis shrinks the failure
    failed: bool = False
    passed: int = 0  # examples of this test that returned (watch_failures): neither failed nor rejected
    # called with (passed, failed) after each example of the current test that returned
    # (watch_failures): the time share's stop (plugin/time_share.py)
    after_passed: object = None

    def refuse(self, reason: str, example) -> NoReturn:
        """Inside a Hypothesis test: reject the example (or skip, or stop, as the class says);
        outside one: skip the test with the reason."""
        general = re.sub(r" \([^()]*\)", "", reason)  # "(batch 3, m=2)", "(3 4 0 1 2 5)"
        self.reasons[general] += 1
        self.first.setdefault(general, reason)
        self._refused[id(example)] = example
        if not currently_in_test_context():
            pytest.skip(reason)
        if self.failed:
            reject()
        if not self.ran() and self.total() >= self.REFUSALS_BEFORE_SKIP:
            pytest.skip(f"no drawn example ran: {self.summary()}")
        if self.total() >= self.REFUSAL_BUDGET:
            raise EnoughRefused(self.note())
        reject()

    def ran_task(self, example) -> None:
        self._ran[id(example)] = example

    def ran(self) -> int:
        """Examples that ran and were not refused."""
        return len(self._ran.keys() - self._refused.keys())

    def total(self) -> int:
        return sum(self.reasons.values())

    def clear(self) -> None:
        self.reasons.clear()
        self.first.clear()
        self._ran.clear()
        self._refused.clear()
        self.failed = False
        self.passed = 0

    def watch_failures(self, test, after_passed=None) -> None:
        """Wrap a Hypothesis test's inner function (``test.hypothesis.inner_test``, Hypothesis's
        documented hook) so that an example that fails (an Exception other than Hypothesis's own,
        such as a rejection) sets ``failed``, one that returns counts in ``passed`` and then calls
        ``after_passed(passed, failed)``, if given (it may stop the test). Once per test function."""
        self.after_passed = after_passed
        handle = getattr(test, "hypothesis", None)
        if handle is None or getattr(handle.inner_test, "_watched_by", None) is self:
            return
        inner = handle.inner_test

        @functools.wraps(inner)
        def watched(*args, **kwargs):
            try:
                result = inner(*args, **kwargs)
            except HypothesisException:  # a rejection; StopTest and pytest's skips are BaseExceptions,
                raise  # not caught below: none of them is a failure
            except Exception:
                self.failed = True
                raise
            self.passed += 1
            if self.after_passed is not None:
                self.after_passed(self.passed, self.failed)
            return result

        watched._watched_by = self
        handle.inner_test = watched

    def summary(self) -> str:
        return "; ".join(f"{count}x {self.first[general]}" for general, count in self.reasons.most_common())

    def note(self) -> str:
        stopped = ", and drawing stopped there" if self.total() >= self.REFUSAL_BUDGET else ""
        return f"{self.ran()} examples ran; {self.total()} drawn examples the library under test cannot run were not{stopped}, as: {self.summary()}"


@dataclass(frozen=True)
class BackendRefusals:
    """What the backend's own collectives refuse, probed once: {(collective, dtype, op): message}."""

    backend: str
    refused: dict

    def dtypes(self, collective: str, op: str | None = None) -> frozenset:
        import torch

        return frozenset(getattr(torch, d) for (c, d, o), _ in self.refused.items() if c == collective and o == op)

    def cases(self, collective: str) -> list[tuple[str, str | None, str]]:
        return sorted(((d, o, m) for (c, d, o), m in self.refused.items() if c == collective), key=str)
