"""Per-capability results of a run: collected from test reports (on the xdist controller too: the
capability travels in each report's user_properties), printed as a scorecard at the end, and
handed to harness.reports for the grading files."""
from __future__ import annotations

import textwrap
from collections import defaultdict
from dataclasses import dataclass

MAX_OUTPUT_CHARS = 6000


@dataclass
class TestResult:
    nodeid: str
    capability: str
    outcome: str  # "passed", "failed", "skipped"
    output: str  # why it failed or was skipped; empty when it passed
    seconds: float


def _capability_of(report) -> str | None:
    for key, value in getattr(report, "user_properties", ()):
        if key == "capability":
            return value
    return None


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
        text = "not implemented: " + text[text.index(marker) + len(marker):]
    return text[:MAX_OUTPUT_CHARS]


def verdict(results: list[TestResult]) -> str:
    """A capability's verdict: FAIL (or "not implemented"), "pass", or "not tested" when none of
    its tests passed or failed (every one skipped: a world it needs could not run, or the
    backend refuses the case)."""
    if any(r.outcome == "failed" for r in results):
        return "not implemented" if any(r.output.startswith("not implemented") for r in results) else "FAIL"
    return "pass" if any(r.outcome == "passed" for r in results) else "not tested"


class Scorecard:
    def __init__(self, config, coverage=lambda: ""):
        self.config = config
        self.coverage = coverage  # () -> the line that says which world sizes ran on which backend
        self.results: dict[str, TestResult] = {}

    def pytest_runtest_logreport(self, report):
        capability = _capability_of(report)
        if capability is None:
            return
        if report.when == "call" or not report.passed:
            previous = self.results.get(report.nodeid)
            if previous is not None and previous.outcome == "failed":
                return  # a teardown error after a failed call: keep the call's explanation
            outcome = "skipped" if report.skipped else ("passed" if report.passed else "failed")
            output = "" if outcome == "passed" else _explain(report)
            self.results[report.nodeid] = TestResult(report.nodeid, capability, outcome, output, report.duration)

    def by_capability(self) -> dict[str, list[TestResult]]:
        rows: dict[str, list[TestResult]] = defaultdict(list)
        for result in self.results.values():
            rows[result.capability].append(result)
        return dict(sorted(rows.items()))

    def pytest_terminal_summary(self, terminalreporter):
        rows = self.by_capability()
        if not rows:
            return
        terminalreporter.section(f"conformance scorecard: {self.config.getoption('--impl')}")
        terminalreporter.write_line(f"coverage: {self.coverage()}")
        width = max(len(name) for name in rows)
        terminalreporter.write_line(f"{'capability':<{width}}  passed  failed  skipped  verdict")
        for name, results in rows.items():
            count = {k: sum(r.outcome == k for r in results) for k in ("passed", "failed", "skipped")}
            terminalreporter.write_line(
                f"{name:<{width}}  {count['passed']:>6}  {count['failed']:>6}  {count['skipped']:>7}  {verdict(results)}")
        verdicts = [verdict(results) for results in rows.values()]
        terminalreporter.write_line("capabilities: " + ", ".join(
            f"{verdicts.count(v)} {v}" for v in ("pass", "FAIL", "not implemented", "not tested") if v in verdicts)
            + ("; --capability names what an implementation claims (unclaimed capabilities are not run)"
               if "not implemented" in verdicts else ""))
