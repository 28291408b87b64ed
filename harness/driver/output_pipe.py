"""A local rank's output reaches its log file through a FIFO that the driver drains: the log file is
the driver's, written by the driver only, so its growth is what the driver itself read from the rank.

Why: the audit subtracts what a rank printed during a task from the kernel's count of the bytes it
wrote (harness/driver/world.py, World._run). When the rank wrote its own log file, the file's size
stood for what it printed, and a rank could grow it without writing a byte (``ftruncate``,
``fallocate``, a write far past the end), then send that many bytes around the recorder unseen
(issue 45, class 2: 30/30 on the audit with 16 MiB hidden). A FIFO holds only bytes written into it,
by calls the kernel counts (the ways around the count, ``splice``, ``vmsplice`` and ``tee``, are
refused in a contained rank: harness/rank/syscall_filter.py), and the rank has no descriptor of the
log file, which is root's in a grading run.

The driver keeps a write end open itself, so the FIFO never reads as closed: the rank can open it
whenever it starts, and a drain stops when the FIFO is empty, not at a rank's exit. A thread per
world moves what arrives into the log files as it comes (a rank that prints more than the FIFO holds
never blocks for long); :meth:`RankPipe.drain` empties a FIFO at once, which the audit's ordering
needs (World._run reads the kernel's count before the drain that starts a task and after the one
that ends it, so every byte credited was written inside the window the count covers).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading

from parallelism_conformance.harness.rank.loop import fifo_path

CHUNK = 1 << 20


class RankPipe:
    """One rank's FIFO and the log file it feeds."""

    def __init__(self, log_path: str):
        self.log_path = log_path
        self.path = fifo_path(log_path)
        os.mkfifo(self.path, 0o600)
        self._read = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._keep_open = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)  # never EOF, whenever the rank opens it
        self._log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._lock = threading.Lock()
        self.moved = 0  # bytes moved into the log file so far

    def fileno(self) -> int:
        return self._read

    def drain(self) -> int:
        """Move everything the FIFO holds now into the log file; the bytes moved."""
        with self._lock:
            return self._drain()

    @contextlib.contextmanager
    def drained(self):
        """Drain, then hold the log file still (no move into it) while the caller reads or empties it."""
        with self._lock:
            self._drain()
            yield

    def _drain(self) -> int:
        total = 0
        while self._read >= 0:
            try:
                moved = os.splice(self._read, self._log, CHUNK, offset_dst=os.fstat(self._log).st_size, flags=os.SPLICE_F_NONBLOCK)
            except BlockingIOError:
                break
            if moved == 0:
                break
            total += moved
        self.moved += total
        return total

    def close(self) -> None:
        with self._lock:
            for fd in (self._read, self._keep_open, self._log):
                if fd >= 0:
                    os.close(fd)
            self._read = self._keep_open = self._log = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Pump:
    """A thread that drains a world's FIFOs as their ranks write (one per world, closed with it)."""

    def __init__(self, pipes: list[RankPipe]):
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        for pipe in pipes:
            self._selector.register(pipe, selectors.EVENT_READ)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="rank-output-pump", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closing:
            for key, _ in self._selector.select():
                if isinstance(key.fileobj, RankPipe):
                    key.fileobj.drain()

    def close(self) -> None:
        self._closing = True
        os.write(self._wake_write, b"x")
        self._thread.join()
        self._selector.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
