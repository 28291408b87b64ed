"""Per-capability results of a run: collected from test reports (on the xdist controller too: the
capability travels in each report's user_properties), printed as a scorecard at the end, and
handed to harness.driver.reports for the grading files."""

from __future__ import annotations

import textwrap
from collections import defaultdict
from dataclasses import dataclass

import pytest

MAX_OUTPUT_CHARS = 6000
NOT_RUN = (
    "not run: the run was stopped before this test reported (a platform's time limit, or the driver "
    "was killed); the points it carries are lost, not removed from the maximum"
)
# The verdict of a test that passed with bytes above the theory's bound reported (a JUnit property,
# and a capability's verdict when none of its tests failed)
COSTS_MORE = "costs more"
# and of one whose values differ from the contract's exactly as a design its library documents
# (conformance/by_design.py): neither a pass nor a fail, counted apart
DIFFERS_BY_DESIGN = "differs by design"
# The exit status of a run whose only failures are functions or classes the implementation does not
# provide (pytest's own: 0 passed, 1 some test failed, 2 interrupted, 3 internal error, 4 usage
# error, 5 no tests). CI can tell "claims less than it was asked for" (name its capabilities with
# --capability) from "got something wrong".
NOT_IMPLEMENTED_ONLY = 6


@dataclass
class TestResult:
    nodeid: str
    capability: str
    outcome: str  # "passed", "failed", "skipped"
    output: str  # why it failed or was skipped; a passed test's notes (often empty)
    seconds: float
    line: int = 0  # of the test's definition in its file (report.location): the grading files' order
    costs_more: bool = False  # passed, with bytes above the theory's bound reported (--require-bounds off)
    by_design: bool = False  # passed against a design its library documents, not the contract's semantics


def _capability_of(report) -> str | None:
    for key, value in getattr(report, "user_properties", ()):
        if key == "capability":
            return value
    return None


def _notes(report) -> str:
    """What a passed test says of itself (refused examples, a stop at its share of the time budget)."""
    return "\n".join(value for key, value in getattr(report, "user_properties", ()) if key == "note")


def _explain(report) -> str:
    """The error lines of a failure (our messages name example, rank, element and a reproducer),
    or the reason of a skip."""
    if report.skipped:
        longrepr = report.longrepr
        return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    lines = [line[1:] for line in report.longreprtext.splitlines() if line.startswith("E ")]
    text = textwrap.dedent("\n".join(lines)) if lines else report.longreprtext
    marker = "the implementation under test is incomplete: "
    if marker in text:
        text = "not implemented: " + text[text.index(marker) + len(marker) :]
    return text[:MAX_OUTPUT_CHARS]


def verdict(results: list[TestResult]) -> str:
    """A capability's verdict: FAIL (or "not implemented"), "pass", or "not tested" when none of
    its tests passed or failed (every one skipped: a world it needs could not run, or the
    backend refuses the case)."""
    if any(r.outcome == "failed" for r in results):
        return "not implemented" if any(r.output.startswith("not implemented") for r in results) else "FAIL"
    if any(r.by_design for r in results):
        return DIFFERS_BY_DESIGN
    if any(r.costs_more for r in results):
        return COSTS_MORE  # right values, more bytes than the theory: never "FAIL", never a plain "pass"
    return "pass" if any(r.outcome == "passed" for r in results) else "not tested"


class Scorecard:
    def __init__(self, config, coverage=lambda: "", warning: str | None = None):
        self.config = config
        self.coverage = coverage  # () -> the line that says which world sizes ran on which backend
        self.warning = warning  # said under the coverage line (an older torch than the suite is tested on)
        self.results: dict[str, TestResult] = {}
        self.failed_elsewhere = 0  # failures that belong to no capability (they always count as failures)
        self.link_reports: dict[str, str] = {}  # test id -> bytes per mesh axis and link class (the audit's)
        # the tests selected to run that have not reported yet: the grading files list them as "not run",
        # so a run stopped from outside (a platform's time limit) keeps its maximum instead of shrinking it
        self.pending: dict[str, TestResult] = {}

    def expect(self, items) -> None:
        """Record the tests this session will run (pytest_collection_finish, in the process that
        collected them: without xdist), each "not run" until its own report arrives."""
        for item in items:
            capability = next((value for key, value in item.user_properties if key == "capability"), None)
            if capability is not None:
                line = (item.location[1] or 0) if item.location else 0
                self.pending[item.nodeid] = TestResult(item.nodeid, capability, "failed", NOT_RUN, 0.0, line)

    def pytest_runtest_logreport(self, report):
        for key, value in getattr(report, "user_properties", ()):
            if key == "link_report":
                self.link_reports[report.nodeid] = value
        capability = _capability_of(report)
        if capability is None:
            self.failed_elsewhere += report.failed
            return
        if report.when == "call" or not report.passed:
            self.pending.pop(report.nodeid, None)
            previous = self.results.get(report.nodeid)
            if previous is not None and previous.outcome == "failed":
                return  # a teardown error after a failed call: keep the call's explanation
            outcome = "skipped" if report.skipped else ("passed" if report.passed else "failed")
            output = _notes(report) if outcome == "passed" else _explain(report)
            line = (getattr(report, "location", None) or ("", 0, ""))[1] or 0  # None: pytest found no line
            verdicts = {value for key, value in getattr(report, "user_properties", ()) if key == "verdict"}
            self.results[report.nodeid] = TestResult(
                report.nodeid, capability, outcome, output, report.duration, line, COSTS_MORE in verdicts, DIFFERS_BY_DESIGN in verdicts
            )

    def only_not_implemented(self) -> bool:
        """Some test failed, and every failure is a function or class the implementation lacks."""
        failed = [r for r in self.results.values() if r.outcome == "failed"]
        return not self.failed_elsewhere and bool(failed) and all(r.output.startswith("not implemented") for r in failed)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if exitstatus == pytest.ExitCode.TESTS_FAILED and self.only_not_implemented():
            session.exitstatus = NOT_IMPLEMENTED_ONLY

    def by_capability(self, with_pending: bool = False) -> dict[str, list[TestResult]]:
        """Results per capability; ``with_pending`` adds the selected tests that have not reported."""
        rows: dict[str, list[TestResult]] = defaultdict(list)
        for result in [*self.results.values(), *(self.pending.values() if with_pending else ())]:
            rows[result.capability].append(result)
        return dict(sorted(rows.items()))

    def pytest_terminal_summary(self, terminalreporter):
        rows = self.by_capability()
        if not rows:
            return
        if self.link_reports:
            terminalreporter.section("communication by mesh axis and link class (the audit)")
            for nodeid, text in sorted(self.link_reports.items()):
                terminalreporter.write_line(f"{nodeid.split('::')[-1]}: {text}")
        terminalreporter.section(f"conformance scorecard: {self.config.getoption('--impl')}")
        terminalreporter.write_line(f"coverage: {self.coverage()}")
        if self.warning:
            terminalreporter.write_line(f"WARNING: {self.warning}")
        width = max(len(name) for name in rows)
        terminalreporter.write_line(f"{'capability':<{width}}  passed  failed  skipped  verdict")
        for name, results in rows.items():
            count = {k: sum(r.outcome == k for r in results) for k in ("passed", "failed", "skipped")}
            terminalreporter.write_line(
                f"{name:<{width}}  {count['passed']:>6}  {count['failed']:>6}  {count['skipped']:>7}  {verdict(results)}"
            )
        verdicts = [verdict(results) for results in rows.values()]
        terminalreporter.write_line(
            "capabilities: "
            + ", ".join(
                f"{verdicts.count(v)} {v}"
                for v in ("pass", COSTS_MORE, DIFFERS_BY_DESIGN, "FAIL", "not implemented", "not tested")
                if v in verdicts
            )
            + (
                "; --capability names what an implementation claims (unclaimed capabilities are not run)"
                if "not implemented" in verdicts
                else ""
            )
        )
        if self.only_not_implemented():
            terminalreporter.write_line(
                f"exit status {NOT_IMPLEMENTED_ONLY}: every failure is something the implementation "
                "does not provide; nothing it provides failed"
            )
