"""What the driver raises when ranks do not complete a task, each naming the rank and the cause."""

from __future__ import annotations

from dataclasses import dataclass, field

from parallelism_conformance.harness.driver.memory_cgroup import OOM_KILLED
from parallelism_conformance.harness.driver.rank_output import shorten

# How much of a rank's captured output a failure report shows: the end (the last traceback, a hung
# rank's stacks) and a little of the start (the first warning or error), with a line saying how many
# bytes between are not shown; the driver keeps more (harness/driver/rank_output.py).
MAX_LOG_CHARS = 4000
REPORT_HEAD_CHARS = 1000


@dataclass
class RankReport:
    """What happened on one rank during one task."""

    rank: int
    # "ok", "raised", "missing" (a name or the module itself), "unloadable" (a dependency it imports is
    # absent), "broken" (the world), "exited", "hung"
    status: str
    detail: str = ""  # traceback, exit cause, or Python stacks of a hung rank
    output: str = ""  # the rank's captured stdout/stderr during the task

    def render(self) -> str:
        lines = [f"--- rank {self.rank}: {self.status}"]
        if self.detail:
            lines.append(self.detail.rstrip())
        if self.output.strip():
            text = shorten(self.output.rstrip(), REPORT_HEAD_CHARS, MAX_LOG_CHARS)
            lines.append(f"--- rank {self.rank} captured output:\n{text}")
        return "\n".join(lines)


@dataclass
class RankFailure(Exception):
    """A task did not complete on every rank: a rank raised, exited (crash, signal) or hung."""

    summary: str
    ranks: list[RankReport] = field(default_factory=list)

    def __post_init__(self):
        super().__init__(self.summary)

    def failed(self) -> list[RankReport]:
        return [r for r in self.ranks if r.status != "ok"]

    def same_error_everywhere(self) -> str | None:
        """The last line of the error if every rank raised the same one (e.g. a missing function)."""
        details = {r.detail.strip().splitlines()[-1] for r in self.ranks if r.detail.strip()}
        if len(details) == 1 and all(r.status in ("raised", "missing", "unloadable", "broken") for r in self.ranks if r.status != "ok"):
            return details.pop()
        return None

    def __str__(self) -> str:
        common = self.same_error_everywhere()
        if common is not None:
            first = self.failed()[0]
            return f"{self.summary}\nevery rank raised the same error:\n{first.detail.rstrip()}"
        return "\n".join([self.summary, *(r.render() for r in self.ranks if r.status != "ok" or r.output.strip())])


class _Unshrinkable(BaseException):
    """Failures that Hypothesis must not shrink by re-running examples. Hypothesis only catches
    Exception, so the test fails at once with this report."""

    def __init__(self, failure: RankFailure):
        super().__init__(str(failure))
        self.failure = failure


class RanksHung(_Unshrinkable):
    """A task passed its deadline: each re-run would cost a whole deadline."""


class RanksDeadlocked(RanksHung):
    """A hang known before the deadline: every rank that had not replied waited in a communication
    call, and no byte moved and no CPU time was spent for a while (harness/driver/deadlock.py)."""


class RanksCrashed(_Unshrinkable):
    """A rank exited, was killed by a signal, broke its process group or left a message nobody
    received: the world is torn down, and each re-run would cost a fresh world."""


class BudgetExhausted(_Unshrinkable):
    """The run's --time-budget is spent: no further task is started."""

    def __init__(self, message: str):
        BaseException.__init__(self, message)
        self.failure = RankFailure(message)


# how a test the container's memory could not hold begins its reason (the reports count them apart)
NOT_GRADED = "not graded: the container's memory"


class ContainerMemory(_Unshrinkable):
    """The kernel killed a rank for memory again after the task was rerun with every other world
    closed: the container cannot hold this task, so the test is not graded (neither for nor
    against the implementation), never a failure (harness/driver/pool.py)."""

    def __init__(self, message: str):
        BaseException.__init__(self, message)
        self.failure = RankFailure(message)


def killed_for_memory(failure: BaseException) -> str:
    """How the first rank the kernel's OOM killer killed in ``failure`` is described ("rank 1 was
    killed by the kernel's out-of-memory killer (...)"), or "" where none was."""
    inner = failure if isinstance(failure, RankFailure) else getattr(failure, "failure", None)
    for report in getattr(inner, "ranks", None) or []:
        if OOM_KILLED in report.detail:
            return f"rank {report.rank} {report.detail.strip().splitlines()[0]}"
    return ""


class ImplementationIncomplete(_Unshrinkable):
    """The implementation under test lacks a name the capability needs, or cannot be imported:
    the same on every example, so there is nothing to shrink."""


class ImplementationUnloadable(_Unshrinkable):
    """The implementation under test imports what this machine lacks (harness/rank/loader.py,
    MissingDependency): a failure, not "not implemented", and the same on every example."""


# Everything a task on ranks can end in besides a result (for ``except`` clauses that annotate it).
TASK_FAILURES = (RankFailure, RanksHung, RanksCrashed, ImplementationIncomplete, ImplementationUnloadable, BudgetExhausted, ContainerMemory)


class WorldStartError(RuntimeError):
    """The ranks of a world could not be started or could not form a process group."""


def task_failure(
    task: str, reports: list[RankReport], disagreements: list[str], timeout_s: float, deadlock: str | None, *, world_closed: bool
) -> BaseException:
    """The failure a task ended in, from every rank's report (``task``: "program on n ranks"): an
    incomplete implementation when every failed rank lacks something, a deadlock (``deadlock``: the
    watch's summary) or a hang when every failed rank hung, a crash when the world had to be closed,
    else a RankFailure. Its first line names each failed rank and the ranks' first disagreement."""
    failed = [r for r in reports if r.status != "ok"]
    causes = ", ".join(
        f"rank {r.rank} {r.status}" + (" (out of memory)" if OOM_KILLED in r.detail else "") for r in failed
    )  # on the first line, the one grading summaries show
    if disagreements:
        causes += f"; the ranks disagree: {disagreements[0]}" + "".join(f"\n  also: {line}" for line in disagreements[1:])
    for status, kind, what in (
        ("missing", ImplementationIncomplete, "is incomplete"),
        ("unloadable", ImplementationUnloadable, "cannot be loaded here"),
    ):
        if all(r.status == status for r in failed):  # the same on every example: nothing to shrink
            cause = failed[0].detail.strip().splitlines()[-1] if failed[0].detail.strip() else "?"
            return kind(RankFailure(f"the implementation under test {what}: {cause}", reports))
    if all(r.status == "hung" for r in failed):
        why = deadlock if deadlock is not None else f"no result within the {timeout_s:g} s deadline"
        return (RanksDeadlocked if deadlock is not None else RanksHung)(RankFailure(f"{task}: {why} ({causes})", reports))
    failure = RankFailure(f"{task} failed: {causes}", reports)
    return RanksCrashed(failure) if world_closed else failure
