"""What the autograder's trials share (tests/test_autograder.py, tests/test_autograder_attacks.py; the
installed fixture is in tests/conftest.py): the zip claims CLAIMED; TIER is Gradescope's 1.5 GB tier
with a quota of two CPUs: the quota is read from inside as on the platform, while the runs can still
use both cores of a busy machine (the tiers' CPU figures are perf's job)."""

from __future__ import annotations

from parallelism_conformance.harness.driver.gradescope import container, trial

CLAIMED = "broadcast,all_reduce"
TIER = container.Limits(cpus=2.0, memory_bytes=1536 << 20)


def grade(installed, files, *, limits: container.Limits = TIER, env=None, settings=None, timeout_s: float = 900):
    graded = trial.grade(installed, files, limits, env=env, settings=settings, timeout_s=timeout_s)
    return graded.outcome, graded.results, graded.root
