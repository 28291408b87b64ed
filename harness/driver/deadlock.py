"""A hang known at once: a deadlock is reported when it happens, not when the task's deadline passes.

Driver side. While a task runs, the driver samples every rank of the world every SAMPLE_INTERVAL_S:

* what its flight recorder's header says (harness/rank/flight_recorder.py): the task the rank runs
  now and how many of its threads are inside a communication call (a ProcessGroup method, or the
  ``Work.wait`` that ``dist.recv``, ``dist.all_reduce`` ... block in);
* the kernel's counters of its process: bytes read and written (``/proc/<pid>/io`` rchar + wchar:
  gloo moves every byte with read/writev on its sockets), CPU time (``/proc/<pid>/stat`` utime +
  stime, in clock ticks), and whether any of its threads is running or runnable (state R) or in
  uninterruptible sleep (D) in ``/proc/<pid>/task/*/stat``.

The verdict (:func:`verdict`, a pure function of the samples): the world is deadlocked when, over at
least MIN_SAMPLES samples spanning at least MIN_STILL_S, every rank that has not replied is inside a
communication call of this task, every rank (replied ones too: a thread they left behind may still
work) kept its byte counts exactly, gained at most CPU_NOISE_TICKS of CPU time between two samples,
and had no thread running. Nothing can then make progress: a message or a collective's data would
move bytes, a computation would use CPU, a starved rank would have a runnable thread.

What is not a deadlock, and why each is safe:

* a rank between calls (a long computation, a sleep, a call the recorder does not see, a rank that
  has not begun the task): it is not inside a call, so the task runs on to its deadline;
* a slow but progressing transfer: bytes move;
* a long pure-CPU operation inside a call (gloo reducing a large tensor): CPU time rises;
* a machine so loaded that ranks wait for a core: their threads are runnable.

A driver without CAP_SYS_PTRACE (a container's default capabilities) may not read a contained
rank's ``/proc/<pid>/io``; the world gives the watch a reader that then asks a forked child of the
ranks' own uid (harness/driver/io_counters.py). Where the counters still cannot be read, the flight
recorder is off or the ranks are on other hosts, nothing is known and the deadline stays the only
judge. NCCL worlds are not watched: a GPU's work and its
NVLink traffic show in none of these counters.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from parallelism_conformance.harness.driver import disagreement
from parallelism_conformance.harness.rank.containment import parse_io_counters
from parallelism_conformance.harness.rank.flight_recorder import ACTIVITY, ACTIVITY_OFFSET, HEADER, MAGIC, P2P

SAMPLE_INTERVAL_S = 0.2  # between samples: a deadlock is known about MIN_STILL_S after it began
MIN_SAMPLES = 3  # at least two intervals of stillness, however late the driver got to sample
MIN_STILL_S = 0.4
# CPU time a waiting rank may gain between two samples without computing: clock ticks are 10 ms
# and a rank's watchdog thread wakes twice a second; a busy loop gains about 20 ticks per interval
CPU_NOISE_TICKS = 2
KEPT_SAMPLES = 16  # the verdict looks at the still tail only; older samples are dropped
BUSY_STATES = frozenset("RD")  # running or runnable; uninterruptible sleep (disk I/O)


@dataclass(frozen=True)
class RankSample:
    """One rank at one instant. None: could not be read (then no verdict)."""

    rank: int
    replied: bool  # its reply to this task is in
    task: int | None  # the task its flight recorder says it runs
    waiting: int | None  # its threads inside a communication call
    io: int | None  # bytes read + written by its process (rchar + wchar)
    cpu: int | None  # utime + stime of its process, clock ticks
    busy: bool | None  # one of its threads is running, runnable or in uninterruptible sleep


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic() when taken
    ranks: tuple[RankSample, ...]


@dataclass(frozen=True)
class Deadlock:
    waiting: tuple[int, ...]  # the ranks inside a communication call
    replied: tuple[int, ...]  # the ranks that returned their result and are idle
    still_s: float  # how long nothing moved, from the first still sample to the last


# ---------------------------------------------------------------------------------- the verdict
def blocked(rank: RankSample, task: int) -> bool:
    """Inside a communication call of this task (a rank still on the last task has not begun)."""
    return rank.task == task and rank.waiting is not None and rank.waiting > 0


def quiet(rank: RankSample) -> bool:
    """Readable, and no thread of it is running or waiting for a core."""
    return rank.io is not None and rank.cpu is not None and rank.busy is False


def settled(sample: Sample, task: int) -> bool:
    """Every rank quiet, every rank that has not replied blocked in a call, and one has not."""
    unreplied = [r for r in sample.ranks if not r.replied]
    return bool(unreplied) and all(quiet(r) for r in sample.ranks) and all(blocked(r, task) for r in unreplied)


def unchanged(before: Sample, after: Sample, cpu_noise_ticks: int = CPU_NOISE_TICKS) -> bool:
    """The same ranks in the same state, not a byte moved, CPU time within the noise."""
    if [(r.rank, r.replied) for r in before.ranks] != [(r.rank, r.replied) for r in after.ranks]:
        return False
    return all(a.io == b.io and 0 <= a.cpu - b.cpu <= cpu_noise_ticks for b, a in zip(before.ranks, after.ranks))


def still_tail(samples: Sequence[Sample], task: int, cpu_noise_ticks: int = CPU_NOISE_TICKS) -> Sequence[Sample]:
    """The longest run of the latest samples that are each settled and unchanged from the one before."""
    start = len(samples)
    while (
        start > 0
        and settled(samples[start - 1], task)
        and (start == len(samples) or unchanged(samples[start - 1], samples[start], cpu_noise_ticks))
    ):
        start -= 1
    return samples[start:]


def verdict(
    samples: Sequence[Sample],
    task: int,
    *,
    min_samples: int = MIN_SAMPLES,
    min_still_s: float = MIN_STILL_S,
    cpu_noise_ticks: int = CPU_NOISE_TICKS,
) -> Deadlock | None:
    """A Deadlock when the still tail has ``min_samples`` samples over ``min_still_s`` or more, else None."""
    tail = still_tail(samples, task, cpu_noise_ticks)
    if len(tail) < min_samples or tail[-1].at - tail[0].at < min_still_s:
        return None
    last = tail[-1].ranks
    return Deadlock(tuple(r.rank for r in last if not r.replied), tuple(r.rank for r in last if r.replied), tail[-1].at - tail[0].at)


def describe(found: Deadlock, last_calls: dict) -> str:
    """The summary's words: "deadlock: every rank is waiting (ranks 1, 2 in all_reduce; rank 0
    returned its result) and no byte moved for 0.6 s". ``last_calls``: rank -> its last call of
    this task (disagreement.Call), where its flight recorder has one."""
    groups: dict[str, list[int]] = {}
    for rank in found.waiting:
        groups.setdefault(_what(last_calls.get(rank)), []).append(rank)
    parts = [f"{_ranks(ranks)} in {what}" for what, ranks in groups.items()]
    if found.replied:
        parts.append(f"{_ranks(found.replied)} returned {'its result' if len(found.replied) == 1 else 'their results'}")
    return f"deadlock: every rank is waiting ({'; '.join(parts)}) and no byte moved for {found.still_s:.1f} s"


def _what(call) -> str:
    if call is None:
        return "a communication call"
    if call.op == "send":
        return f"send to {call.peer}"
    if call.op in P2P:
        return "recv from any" if call.peer is None else f"recv from {call.peer}"
    return call.op


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


# ----------------------------------------------------------------------------------- the readers
def read_activity(ring: str) -> tuple[int, int] | None:
    """(the task the rank runs, its threads inside a call) from its flight recorder's header."""
    try:
        with open(ring, "rb") as file:
            header = file.read(HEADER.size)
    except OSError:
        return None
    if len(header) < HEADER.size or header[: len(MAGIC)] != MAGIC:
        return None
    return ACTIVITY.unpack_from(header, ACTIVITY_OFFSET)


def read_io_counters(pid: int) -> dict[str, int] | None:
    """/proc/<pid>/io as {"rchar": ..., "wchar": ...}, or None where refused (another uid, without
    CAP_SYS_PTRACE) or gone."""
    try:
        with open(f"/proc/{pid}/io") as io:
            return parse_io_counters(" ".join(line.replace(":", "").strip() for line in io))
    except OSError:
        return None


def bytes_moved(counters: dict[str, int] | None) -> int | None:
    """rchar + wchar: every byte a process read or wrote through read/write-family calls, sockets
    included (None where its counters are unknown)."""
    if counters is None or "rchar" not in counters or "wchar" not in counters:
        return None
    return counters["rchar"] + counters["wchar"]


def read_io(pid: int) -> int | None:
    """:func:`bytes_moved` of a process this process may read."""
    return bytes_moved(read_io_counters(pid))


def read_cpu(pid: int) -> tuple[int, bool] | None:
    """(utime + stime of the whole process in clock ticks, whether a thread of it is in BUSY_STATES).
    /proc/<pid>/stat is readable for every uid; the fields after the command's closing parenthesis
    are state, ppid, ... with utime and stime 12th and 13th (proc(5))."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        busy = False
        for thread in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{thread}/stat") as stat:
                busy = busy or stat.read().rsplit(")", 1)[1].split()[0] in BUSY_STATES
        return int(fields[11]) + int(fields[12]), busy
    except (OSError, IndexError, ValueError):
        return None


def sample_rank(rank: int, pid: int, ring: str, replied: bool, io: int | None) -> RankSample:
    activity, cpu = read_activity(ring), read_cpu(pid)
    return RankSample(
        rank,
        replied,
        None if activity is None else activity[0],
        None if activity is None else activity[1],
        io,
        None if cpu is None else cpu[0],
        None if cpu is None else cpu[1],
    )


# ------------------------------------------------------------------------------------- the watch
class Watch:
    """Samples one task's ranks while the driver waits for their replies.

    ``ranks``: (rank, pid, flight recorder path) for every rank of the world; ``read_io``: the I/O
    counts of those pids, in order (None where unreadable). The driver waits at most :meth:`timeout`
    at a time and calls :meth:`check` after each wait."""

    def __init__(
        self,
        ranks: Sequence[tuple[int, int, str]],
        task: int,
        *,
        interval_s: float = SAMPLE_INTERVAL_S,
        clock=time.monotonic,
        read_io: Callable[[Sequence[int]], list[int | None]] = lambda pids: [read_io(p) for p in pids],
    ):
        self.ranks = list(ranks)
        self.task = task
        self._read_io = read_io
        self.interval_s = interval_s
        self.found: Deadlock | None = None
        self._clock = clock
        self._samples: deque[Sample] = deque(maxlen=KEPT_SAMPLES)
        self._next = clock() + interval_s

    def timeout(self, remaining: float) -> float:
        """How long the driver may wait for replies before the next sample is due."""
        return max(0.0, min(remaining, self._next - self._clock()))

    def check(self, replied: Collection[int]) -> Deadlock | None:
        """Sample when one is due; the Deadlock once the samples show one (kept in ``found``)."""
        now = self._clock()
        if self.found is None and now >= self._next:
            self._next = now + self.interval_s
            counts = self._read_io([pid for _, pid, _ in self.ranks])
            ranks = tuple(sample_rank(rank, pid, ring, rank in replied, io) for (rank, pid, ring), io in zip(self.ranks, counts))
            self._samples.append(Sample(now, ranks))
            self.found = verdict(list(self._samples), self.task)
        return self.found

    def summary(self) -> str:
        """describe() of the deadlock found, naming each waiting rank's last call of this task."""
        assert self.found is not None
        last_calls = {}
        for rank, _pid, ring in self.ranks:
            found = disagreement.read(ring)
            if found is not None and found[0] == self.task and found[1]:
                last_calls[rank] = found[1][-1]
        return describe(self.found, last_calls)
