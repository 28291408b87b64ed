"""The driver's side of one rank process: its exit described (a signal, an OOM kill), its output read
as it goes, and its stacks dumped when it hangs."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from parallelism_conformance.harness.driver import memory_cgroup, output_pipe, rank_memory, rank_output
from parallelism_conformance.harness.rank.loop import STACK_DUMP_SIGNAL

STACK_DUMP_WAIT_S = 5.0
# multiprocessing's exit code of a forkserver child whose forkserver died (popen_forkserver.poll:
# "perhaps the forkserver process itself got killed"); the ranks die with it (PR_SET_PDEATHSIG)
FORKSERVER_GONE = 255  # a hung rank writes its stacks in milliseconds; this bounds one that will not


@dataclass
class RankHandle:
    """The driver's handle on one rank: its process (None when a launcher started it), its control
    connection, how far its output has been read, and the memory cgroup that may have killed it."""

    rank: int
    process: multiprocessing.Process | None  # None: attached by a launcher (torchrun), maybe on another host
    log_path: str | None  # None for attached ranks: their output goes to their launcher's console
    conn: Connection | None = None
    # How far into this rank's output the driver has read: every byte it printed, counted whether
    # kept or not (harness/driver/rank_output.py); the audit subtracts a task's share from the
    # kernel's count of bytes the rank wrote (World._run). Its log file may be emptied meanwhile:
    # log_position is where the driver stopped in the file.
    log_offset: int = 0
    log_position: int = 0
    reply_bytes: int = 0  # the last reply's size on the control connection, framing included
    memory: memory_cgroup.MemoryCgroup | None = None  # the memory cgroup it lives in; None: unknown
    oom_kills_before: int | None = None  # that cgroup's OOM kill count when the current task started
    pipe: output_pipe.RankPipe | None = None  # the FIFO its output comes through (local ranks)
    # what a contained rank said when it joined, before the implementation loaded: the inode of its
    # store connection (the one socket it may send on, counted by the driver: socket_counters) and,
    # where its system call filter could not be installed, why (harness/rank/syscall_filter.py)
    store_socket: int | None = None
    unfiltered: str = ""
    cost: rank_memory.RankCost | None = None  # its resident set at join, to measure its growth (local ranks)

    def __post_init__(self):
        # found while the rank is alive: once it died, its /proc entry is gone
        self.memory = None if self.process is None else memory_cgroup.of_process(self.process.pid)
        self.cost = None if self.process is None else rank_memory.RankCost(self.process.pid)
        self.note_oom_kills()

    def joined(self, ready: tuple) -> None:
        """Keep what its "ready" message said (harness/rank/loop.py: serve), and its resident set now."""
        self.store_socket, self.unfiltered = (*ready, None, "")[2:4]
        if self.cost is not None:
            self.cost.note_join()

    def note_oom_kills(self) -> None:
        """Note its memory cgroup's OOM kill count now: describe_exit compares (one read of
        memory.oom_control, about 10 us)."""
        self.oom_kills_before = None if self.memory is None else self.memory.oom_kills()

    def killed_for_memory(self) -> bool:
        """It died by SIGKILL, or with its forkserver, and its memory cgroup's OOM kill count rose since
        it last finished a task or started one: the kernel's OOM killer killed it or its forkserver
        (harness/driver/memory_cgroup.py, harness/rank/oom_order.py)."""
        if self.process is None or self.process.exitcode not in (-signal.SIGKILL, FORKSERVER_GONE) or self.oom_kills_before is None:
            return False
        after = self.memory.oom_kills()
        return after is not None and after > self.oom_kills_before

    @property
    def attached(self) -> bool:
        return self.process is None

    def waitables(self) -> list:
        return [self.conn] if self.process is None else [self.conn, self.process.sentinel]

    def has_exited(self) -> bool:
        return self.process is not None and self.process.exitcode is not None

    def describe_exit(self) -> str:
        if self.process is None:
            return "closed its connection to the driver (an attached rank: its launcher's console shows why)"
        self.process.join(timeout=1.0)
        if self.killed_for_memory():
            peak = None if self.cost is None else self.cost.last_peak
            seen = "" if peak is None else f"; its resident set had peaked at {peak / 2**20:.0f} MiB when last read"
            how = " (with its forkserver: multiprocessing reads exit code 255)" if self.process.exitcode == FORKSERVER_GONE else ""
            return memory_cgroup.describe_oom_kill(self.memory.limit()) + how + seen
        return _describe_exit(self.process.exitcode)

    def read_new_output(self) -> str:
        """What the rank printed since the driver last looked: its head and tail, the bytes between
        counted (rank_output.read_new: the driver's memory is bounded whatever a rank prints)."""
        if self.log_path is None:
            return ""
        with self._output_still():
            try:
                text, consumed, self.log_position = rank_output.read_new(self.log_path, self.log_position)
            except FileNotFoundError:
                return ""
        self.log_offset += consumed
        return text

    def begin_task(self) -> None:
        """Before a task: forget what the rank printed between tasks (no test's output), counted but
        not read, its log file emptied past rank_output.LOG_FILE_LIMIT; and note its OOM kill count."""
        if self.log_path is not None:
            with self._output_still():  # drained after the kernel's count was read: written before the task
                try:
                    passed, self.log_position = rank_output.pass_over(self.log_path, self.log_position)
                    self.log_offset += passed
                except FileNotFoundError:
                    pass
        self.note_oom_kills()

    def _output_still(self):
        """Its FIFO drained, and its log file held still while the driver reads or empties it."""
        return contextlib.nullcontext() if self.pipe is None else self.pipe.drained()

    def remove_log(self) -> None:
        """Delete its log file: its world is closed and nobody reads it again (a rank that printed
        1 GiB in its last task would otherwise keep 1 GiB on disk until the session ends)."""
        if self.pipe is not None:
            self.pipe.close()
        if self.log_path is not None:
            try:
                os.unlink(self.log_path)
            except FileNotFoundError:
                pass


def dump_stacks(hung: list[RankHandle]) -> None:
    """Every thread's stack of each hung local rank, in its log, complete when this returns.
    A rank dies of STACK_DUMP_SIGNAL once it has written its dump (harness/rank/loop.py), so its
    exit is the event to wait for: a few milliseconds, where a fixed sleep was either too long or,
    under load, too short for the stacks. A rank that has not died within STACK_DUMP_WAIT_S (it
    blocked or replaced the signal) is killed without them. Either way no hung rank is left
    alive, so closing the world does not wait for ranks that cannot answer."""
    local = [rank for rank in hung if not rank.attached]
    for rank in local:
        _signal(rank.process, STACK_DUMP_SIGNAL)
    waiting = {rank.process.sentinel: rank for rank in local}
    deadline = time.monotonic() + STACK_DUMP_WAIT_S
    while waiting and time.monotonic() < deadline:
        for sentinel in wait(list(waiting), timeout=max(0.0, deadline - time.monotonic())):
            del waiting[sentinel]
    for rank in waiting.values():
        rank.process.kill()


def _signal(process: multiprocessing.Process, signum: int) -> None:
    try:
        os.kill(process.pid, signum)
    except (ProcessLookupError, TypeError):
        pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"
