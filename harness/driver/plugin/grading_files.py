"""The grading files of a run with --report-dir: results.json, junit.xml and summary.txt."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from parallelism_conformance.harness.driver.plugin.options import claimed
from parallelism_conformance.harness.driver.plugin.profiles import current_profile
from parallelism_conformance.harness.driver.plugin.state import STATE, shown
from parallelism_conformance.harness.driver.reports import hypothesis_settings
from parallelism_conformance.harness.driver.reports import versions as run_versions
from parallelism_conformance.harness.driver.reports import write as write_reports
from parallelism_conformance.harness.driver.rubric import Rubric
from parallelism_conformance.harness.driver.scorecard import Scorecard


def junit_key():
    """pytest's stash key of the JUnit writer (private to pytest; tests/test_suite_end_to_end.py
    fails when the coverage property stops reaching junit.xml)."""
    try:
        from _pytest.junitxml import xml_key
    except ImportError:  # pytest moved it: the property is a nicety, the run goes on
        return None
    return xml_key


class GradingFiles:
    """Writes results.json and summary.txt when the session starts, after every test and at the end
    (harness/driver/reports.py), so that a run stopped from outside still leaves its last state."""

    def __init__(self, config, scorecard: Scorecard, rubric: Rubric):
        self.config, self.scorecard, self.rubric = config, scorecard, rubric
        self.started = time.monotonic()
        # read now, like the rubric, before any rank starts: a rank cannot change what is recorded
        self.run = {"versions": run_versions(), "claimed": sorted(claimed(config))}

    def write(self, complete: bool) -> None:
        state = self.config.stash.get(STATE, None)
        if state is not None and state.live_ranks.memory is not None:  # what the live-rank cap rests on, as it stands
            self.run["memory"] = state.live_ranks.memory.describe()
            self.run["memory_kills"] = list(state.live_ranks.memory.kills)
        write_reports(
            self.scorecard,
            Path(self.config.getoption("--report-dir")),
            self.rubric,
            Path(self.config.getoption("--rubric")),
            self.implementation(),
            seconds=time.monotonic() - self.started,
            complete=complete,
            points_possible=self.config.getoption("--points-possible"),
            run=self.run,
        )

    def implementation(self) -> str:
        """--impl as the report names it: under the grading profile a file by its path in the run's
        folder or its name, never a grading machine's staging folder (state.shown)."""
        impl = self.config.getoption("--impl")
        return shown(impl, os.path.basename(impl)) if current_profile() == "grading" else impl

    def pytest_sessionstart(self, session):
        # after Hypothesis's own pytest_configure has loaded --hypothesis-profile and --hypothesis-seed
        self.run["hypothesis"] = hypothesis_settings(current_profile(), session.config.getoption("--hypothesis-seed", None))
        self.write(complete=False)

    @pytest.hookimpl(trylast=True)  # after the scorecard has taken the report
    def pytest_runtest_logreport(self, report):
        if report.when == "teardown":
            self.write(complete=False)

    def pytest_unconfigure(self, config):
        self.write(complete=True)
