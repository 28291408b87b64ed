"""What the driver keeps about the session, in ``config.stash``: what is under test and where it runs
(the target and its backend plan), the time budget, and the per-test records."""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass, field

import pytest

from parallelism_conformance.harness.driver import memory_cgroup
from parallelism_conformance.harness.driver.backends import BackendPlan, visible_gpus
from parallelism_conformance.harness.driver.gradescope import limits
from parallelism_conformance.harness.driver.plugin.options import GRADING_BUDGET_S, attached_world
from parallelism_conformance.harness.driver.plugin.profiles import current_profile
from parallelism_conformance.harness.driver.plugin.refusals import Refusals
from parallelism_conformance.harness.driver.plugin.time_share import TimeShare
from parallelism_conformance.harness.driver.pool import LiveRanks
from parallelism_conformance.harness.driver.rank_memory import MemoryBudget


@dataclass(frozen=True)
class Target:
    """What is under test and where it runs, as the driver knows it (never the module itself)."""

    impl: str
    backend: str  # the --backend option; plan.backend(n) is what a world of n ranks runs on
    max_world_size: int
    profile: str
    attach: str = ""  # the --attach options of this run, if any
    plan: BackendPlan | None = None
    scope: str = "contract"  # --scope: the contract, or a handout's narrower loop (SCOPES)
    perturb: str = "off"  # --perturb-timing, resolved: "on" (calls complete late by a drawn schedule), "every", "off"

    def reproduce(self, nodeid: str) -> str:
        """The command that reruns one test; a CS336 submission's folder is part of it."""
        submission = os.environ.get("CS336_SUBMISSION") if self.impl == "parallelism_conformance.adapters.cs336" else None
        # a grader's staging folders are nobody's business in a student's report: there, paths outside
        # the run's folder are shown as the student has them (their repository, their file's name)
        graded = self.profile == "grading"
        impl = shown(self.impl, os.path.basename(self.impl)) if graded else self.impl
        submission = shown(submission, "your-repository") if graded and submission else submission
        return (
            (f"CS336_SUBMISSION={shlex.quote(submission)} " if submission else "")
            + f"parallelism-conformance {shlex.quote(nodeid)} --impl {shlex.quote(impl)} --backend {self.backend} "
            f"--hypothesis-profile={self.profile} --max-world-size {self.max_world_size}{self.attach}"
            f" --perturb-timing {self.perturb}" + (f" --scope {self.scope}" if self.scope != "contract" else "")
        )


def shown(path: str, elsewhere: str) -> str:
    """A path as a graded report shows it: relative where it is under this run's folder, else
    ``elsewhere``; a module name as it is."""
    if not os.path.isabs(path):
        return path
    relative = os.path.relpath(path)
    return elsewhere if relative.startswith("..") else relative


def backend_plan(config) -> BackendPlan:
    """Which backend each world size runs on in this session (harness/driver/backends.py), decided once."""
    plan = config.stash.get(PLAN, None)
    if plan is None:
        asked = config.getoption("--max-world-size") or (8 if current_profile() == "thorough" else 4)
        attach = attached_world(config)
        if attach is not None:
            asked = attach.size  # the attached world is the largest drawn; smaller ones run here
        plan = config.stash[PLAN] = BackendPlan.resolve(config.getoption("--backend"), visible_gpus(), asked)
    return plan


PLAN = pytest.StashKey[BackendPlan]()


class Budget:
    """The run's --time-budget (the grading profile's default when not given), counted from the
    session's start in this process."""

    def __init__(self, config):
        self.seconds = config.getoption("--time-budget") or (GRADING_BUDGET_S if current_profile() == "grading" else None)
        self.deadline = None if self.seconds is None else time.monotonic() + self.seconds

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def spent(self) -> bool:
        return self.left() <= 0


def live_ranks(config) -> LiveRanks:
    """The session's cap on live ranks: --max-live-ranks as a number, and what the container's memory
    holds of ranks as costly as measured (harness/driver/rank_memory.py), the first estimate
    --rank-memory MiB where given (the autograder's: a light rank plus what the submission's import
    added)."""
    option, first = config.getoption("--max-live-ranks"), config.getoption("--rank-memory")
    memory = MemoryBudget(limits.read().memory_bytes, cgroup=memory_cgroup.of_process(os.getpid()))
    if first != "auto":
        memory.first_rank_bytes = int(first) << 20
    return LiveRanks(None if option == "auto" else int(option), memory)


@dataclass
class Designs:
    """What the library under test declares of its documented behaviours (name -> (the behaviour, its
    source): options.declared_designs) and the current test's "differs by design" findings
    (RunState.designs; conformance/by_design.py judges them)."""

    declared: dict = field(default_factory=dict)
    findings: list = field(default_factory=list)


@dataclass
class RunState:
    """What the driver keeps about this run between tests (in config.stash, made in pytest_configure)."""

    budget: Budget
    live_ranks: LiveRanks = field(default_factory=LiveRanks)  # the cap shared by the session's pools
    world_sizes: set = field(default_factory=set)  # of the current test's tasks (emptied before each test)
    hung: dict = field(default_factory=dict)  # capability -> the test in which its ranks hung
    refusals: Refusals = field(default_factory=lambda: Refusals())  # of the current test (emptied before each)
    share: TimeShare | None = None  # the current test's share of the budget (made with the state)

    costs: list = field(default_factory=list)  # the current test's costs-more findings (conformance/audit/common.py: check)
    designs: list = field(default_factory=list)  # the current test's differs-by-design findings (conformance/by_design.py)
    memory_kills_reported: int = 0  # of live_ranks.memory.kills, those already noted on a test

    def __post_init__(self):
        if self.share is None:
            self.share = TimeShare(self.budget)

    def memory_kills_since_last(self) -> list[str]:
        """The ranks the kernel killed for memory since the last test's report, as notes for this one
        (each task was rerun with every other world closed: harness/driver/pool.py)."""
        memory = self.live_ranks.memory
        if memory is None:
            return []
        new, self.memory_kills_reported = memory.kills[self.memory_kills_reported :], len(memory.kills)
        return [
            f"memory: the kernel killed a rank for memory, not the implementation: {kill}; rerun with every other world closed" for kill in new
        ]


STATE = pytest.StashKey[RunState]()
