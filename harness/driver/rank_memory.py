"""What a rank costs in memory while it runs, read by the driver from the kernel, and how many ranks
a memory-limited container can keep alive at once.

A grading container holds the driver, the forkserver and every live rank in one memory cgroup. The
number of ranks kept alive was once derived from what importing the submission added to a rank;
a real CS336 repository's training rank costs several times that, and the kernel's OOM killer then
killed ranks mid-step, a different number of tests in each run (issue 60). Here the cost is what a
rank of *this* submission reached while it trained:

    cost(rank) = IDLE_RANK_BYTES + (RssAnon - RssAnon at join) + (VmHWM - VmRSS)

from /proc/<pid>/status (proc(5)): the anonymous memory its tasks added and still hold (the
implementation's import, its models, its caches), plus how far its resident set once stood above
now (``VmHWM`` is the kernel's high-water mark: buffers since freed). File pages are left out: the
libraries every rank maps are charged to the container once. ``IDLE_RANK_BYTES`` is what an idle
forked rank owns beside the pages it shares with the forkserver (measured, below). Both figures are the kernel's,
read by the driver: a rank can only lower its high-water mark (``clear_refs``), which makes the
driver keep more ranks alive, the kernel then kills one, and the task is rerun with fewer (pool.py):
a lie costs the liar time, never a grade.

The estimate of one rank is the largest cost seen so far, so the number of live ranks only goes
down as larger worlds and models are drawn. Driver side only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Measured on the 2-core machine (docs/measured.md, "Grading tiers"): the driver with torch, pytest
# and Hypothesis imported, plus the forkserver that holds torch for the ranks.
DRIVER_BYTES = 450 << 20
# What a forked rank owns beside the forkserver's shared pages, idle after joining its process group
# (smaps_rollup Private_Clean + Private_Dirty of each rank of a gloo world of 4, 2026-12-07: 11 MiB),
# rounded up.
IDLE_RANK_BYTES = 16 << 20
# The first estimate, before any rank of this run has been measured: a light rank (the project's own
# fixtures) after models and collectives, as its PSS share (110 MiB measured, 128 kept: one rank fewer
# left a rank's worth of room at 1 vCPU / 1.5 GiB; harness/driver/gradescope/limits.py).
FIRST_RANK_BYTES = 128 << 20
SMALLEST_WORLD = 1  # one world of the size drawn always runs: the cap never refuses a task


def status_bytes(text: str, name: str) -> int | None:
    """A ``kB`` field of the text of /proc/<pid>/status in bytes (``VmHWM:   123456 kB``)."""
    for line in text.splitlines():
        if line.startswith(name + ":"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None


def read_status(pid: int) -> tuple[int, int, int] | None:
    """(VmHWM, VmRSS, RssAnon) of process ``pid`` in bytes, or None where it is gone or unreadable.
    The file is world-readable and needs no capability (a contained rank of another uid included)."""
    try:
        with open(f"/proc/{pid}/status") as file:
            text = file.read()
    except OSError:
        return None
    fields = [status_bytes(text, name) for name in ("VmHWM", "VmRSS", "RssAnon")]
    return None if None in fields else tuple(fields)


@dataclass
class MemoryBudget:
    """The container's memory and what one live rank is taken to cost in it. ``limit_bytes`` None:
    no limit (every world stays warm). ``first_rank_bytes``: the estimate before a rank is measured
    (a light rank, plus what the submission's import added where the autograder measured it)."""

    limit_bytes: int | None
    first_rank_bytes: int = FIRST_RANK_BYTES
    driver_bytes: int = DRIVER_BYTES
    measured_bytes: int = 0  # the largest cost of one rank seen in this run
    measured_where: str = ""  # which task of which world showed it
    # what the container held beside its ranks' own memory, at its largest (observe_base): the driver,
    # the forkserver, the libraries every process maps. Measured ranks are counted against it, the
    # first estimate (a PSS share, calibrated with DRIVER_BYTES) against driver_bytes
    base_bytes: int = 0
    kills: list[str] = field(default_factory=list)  # every rank the kernel killed for memory, as the report says it
    cgroup: object = None  # the driver's memory cgroup (memory_cgroup.MemoryCgroup), read for observe_base

    def rank_bytes(self) -> int:
        """What one live rank is taken to cost: the larger of the first estimate and the largest measured."""
        return max(self.first_rank_bytes, self.measured_bytes)

    def ranks_that_fit(self) -> int | None:
        """How many ranks may be alive at once (never fewer than one world's worth: the cap closes idle
        worlds, it never refuses the task at hand); None without a limit."""
        if self.limit_bytes is None:
            return None
        first = (self.limit_bytes - self.driver_bytes) // self.first_rank_bytes
        measured = (self.limit_bytes - max(self.driver_bytes, self.base_bytes)) // self.measured_bytes if self.measured_bytes else first
        return max(SMALLEST_WORLD, min(first, measured))

    def observe_base(self, held: int | None, ranks_private: int) -> bool:
        """The container held ``held`` bytes it cannot reclaim (memory_cgroup.held) while its live
        ranks' own memory came to ``ranks_private``: the rest is the base every rank is counted
        against; True when it rose (fewer ranks now fit)."""
        if held is None or held - ranks_private <= self.base_bytes:
            return False
        before, self.base_bytes = self.ranks_that_fit(), held - ranks_private
        return self.ranks_that_fit() != before

    def observe(self, peaks: list[int], where: str) -> bool:
        """Take the costs of a task's ranks (``peaks``: each rank's growth past its join, from
        :meth:`RankCost.growth`); True when the estimate rose (fewer ranks now fit)."""
        largest = max(peaks, default=0) + IDLE_RANK_BYTES if peaks else 0
        if largest <= self.measured_bytes:
            return False
        before = self.rank_bytes()
        self.measured_bytes, self.measured_where = largest, where
        return self.rank_bytes() > before

    def note_kill(self, text: str) -> None:
        self.kills.append(text)

    def too_many(self, alive: int) -> None:
        """The kernel killed a rank while ``alive`` ranks were up: from now on one fewer fits (a rank
        is taken to cost at least a share of the room that ``alive - 1`` would fill)."""
        if self.limit_bytes is None or alive <= 1:
            return
        floor = (self.limit_bytes - max(self.driver_bytes, self.base_bytes)) // (alive - 1)  # then exactly alive - 1 fit
        if floor > self.measured_bytes:
            self.measured_bytes, self.measured_where = floor, f"raised after a kill with {alive} ranks alive"

    def describe(self) -> str:
        """One line for the report: the cap and what it rests on."""
        measured = f"{self.measured_bytes / 2**20:.0f} MiB measured ({self.measured_where})" if self.measured_bytes else "none measured yet"
        if self.limit_bytes is None:
            return f"no memory limit: every world stays warm (largest rank {measured})"
        base = f", beside {self.base_bytes / 2**20:.0f} MiB the container held besides its ranks" if self.base_bytes else ""
        return (
            f"{self.limit_bytes / 2**20:.0f} MiB: at most {self.ranks_that_fit()} live ranks of "
            f"{self.rank_bytes() / 2**20:.0f} MiB each (largest rank {measured}{base})"
        )


@dataclass
class RankCost:
    """One local rank's anonymous memory when it joined, to measure its growth from (the kernel's
    figures). Only anonymous pages count: the shared libraries a rank maps (torch's, triton's) sit in
    the page cache once for the whole container, however many ranks map them."""

    pid: int
    joined_anon: int | None = None
    last_peak: int | None = None  # VmHWM when last read: what a report can say of a rank since killed

    def note_join(self) -> None:
        status = read_status(self.pid)
        self.joined_anon = None if status is None else status[2]

    def current(self) -> int:
        """What the rank holds of its own now: its anonymous growth since it joined and the idle share."""
        status = read_status(self.pid)
        return IDLE_RANK_BYTES + (0 if status is None or self.joined_anon is None else max(0, status[2] - self.joined_anon))

    def growth(self) -> int | None:
        """How far the rank's anonymous memory has peaked above its size at join: what it holds now
        beyond then, plus how far its resident set once stood above now (VmHWM - VmRSS, freed since,
        taken to have been anonymous); None where unknown."""
        status = read_status(self.pid)
        if status is None or self.joined_anon is None:
            return None
        peak, now, anon = status
        self.last_peak = peak
        return max(0, anon - self.joined_anon + peak - now)
