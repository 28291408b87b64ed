"""Fixtures of the project's own tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from parallelism_conformance.harness.driver.gradescope import config, container, trial
from parallelism_conformance.harness.driver.pool import WorldPool
from parallelism_conformance.harness.driver.warm_pytest import WarmPytest
from parallelism_conformance.harness.rank.preload import PRELOAD
from tests.autograder_trial import CLAIMED, TIER

ROOT = Path(__file__).parent.parent
# the fixtures are implementations and a CS336 repository, whose own tests (tests/test_fsdp.py there)
# say where its layers are: they are read by the suite, never collected as the project's tests
collect_ignore = ["fixtures"]
SUITE_TIMEOUT_S = 600.0  # a guard against a run that never ends, never a measure: runs take seconds


class SuiteRunner:
    """Runs ``python -m pytest ARGS`` from the repository's root as a user would, each run its own
    process and pytest session, forked from a template that imported torch once and whose forkserver
    forks every run's ranks (harness/driver/warm_pytest.py): a run then skips about 2.5 s of CPU of
    imports (its own interpreter's torch, its forkserver's torch and torch._dynamo). A run's stdout
    and stderr are one stream there: the result holds it as both."""

    def __init__(self, warm: WarmPytest):
        self._warm = warm

    def run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        code, output, _ = self._warm.run(list(args), cwd=str(ROOT), env=env, timeout_s=SUITE_TIMEOUT_S)
        return subprocess.CompletedProcess([sys.executable, "-m", "pytest", *args], code, output, output)


@pytest.fixture(scope="session")
def suite_runner():
    with WarmPytest(forkserver_preload=PRELOAD) as warm:
        yield SuiteRunner(warm)


@pytest.fixture(scope="session")
def installed():
    """The zip built for CLAIMED (tests/autograder_trial.py), unpacked and installed by its own
    setup.sh (trial.install), once for every file that grades in the emulated container."""
    reason = container.unavailable(TIER)
    if reason:
        pytest.skip(f"no grading container can be emulated here: {reason}")
    installed = trial.install(config.AutograderConfig(expects="student_impl.py", capability=CLAIMED, suite_version="test").check())
    yield installed
    trial.remove(installed)


@pytest.fixture(scope="module")
def training_pool():
    """Gloo ranks for a module's training runs (the loss-blind side-by-sides): a deadline for steps
    of training, not for a hang."""
    with WorldPool("gloo", timeout_s=60.0) as pool:
        yield pool
