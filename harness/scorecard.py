"""Per-capability tallies printed at the end of a run. Works under pytest-xdist: the capability
travels in each report's user_properties, which xdist sends back to the controller."""
from __future__ import annotations

from collections import defaultdict


class Scorecard:
    def __init__(self, config):
        self.config = config
        self.rows: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))

    @staticmethod
    def capability_of(report) -> str | None:
        for key, value in getattr(report, "user_properties", ()):
            if key == "capability":
                return value
        return None

    def pytest_runtest_logreport(self, report):
        capability = self.capability_of(report)
        if capability is None:
            return
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = "skipped" if report.skipped else ("passed" if report.passed else "failed")
            self.rows[capability][outcome].append(report.nodeid)
        elif report.when == "teardown" and report.failed:
            self.rows[capability]["failed"].append(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.rows:
            return
        impl = self.config.getoption("--impl")
        terminalreporter.section(f"conformance scorecard: {impl}")
        width = max(len(name) for name in self.rows)
        terminalreporter.write_line(f"{'capability':<{width}}  passed  failed  skipped  verdict")
        for name in sorted(self.rows):
            row = self.rows[name]
            passed, failed, skipped = (len(row[k]) for k in ("passed", "failed", "skipped"))
            verdict = "FAIL" if failed else ("pass" if passed else "skipped")
            terminalreporter.write_line(f"{name:<{width}}  {passed:>6}  {failed:>6}  {skipped:>7}  {verdict}")
