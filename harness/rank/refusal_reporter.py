"""Names the system calls a contained rank's allow list refused (harness/rank/syscall_allowlist.py),
so that a test that fails on one says which call, where a bare EPERM says nothing.

The allow list's filter answers a call outside it with SECCOMP_RET_USER_NOTIF: the kernel holds the
calling thread and hands the call to whoever holds the filter's listener. That is a helper process,
forked from the rank before any filter and before the implementation loads; it takes the listener
from the rank (SCM_RIGHTS), and for every call it is handed sends the call's name to the rank on a
socket of their own, then answers EPERM. The rank reads the names after each task and adds them to
the failure's text (harness/rank/loop.py).

Why a process and not a thread: a thread of the rank answering would need the GIL, which the caller
may hold (a C extension's call made without releasing it), and the rank would wait on itself for ever.

What the helper is not: evidence. It is of the rank's uid, so the implementation may kill it (each
refused call then fails with ENOSYS instead, unnamed: refused all the same, by the kernel) or read
its socket first; the refusal is the kernel's, the name only a diagnosis for honest code. It cannot be
made to act for the rank: it is undumpable (its memory and /proc files are root's), the rank may not
ptrace (harness/rank/syscall_filter.py), and what reaches it from the rank is a call's number.

Measuring (CONFORMANCE_SYSCALL_MEASURE=<folder>): the helper lets every call it is handed go on
(SECCOMP_USER_NOTIF_FLAG_CONTINUE) and appends each new name to <folder>/<pid>.calls: how the allow
list was measured (harness/rank/syscall_allowlist.py says the command).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import warnings
from collections import Counter

from parallelism_conformance.harness.rank import syscall_numbers

# linux/seccomp.h: struct seccomp_notif (80 bytes) and struct seccomp_notif_resp (24 bytes)
NOTIF_RECV, NOTIF_SEND = 0xC0502100, 0xC0182101
FLAG_CONTINUE = 1
PR_SET_DUMPABLE, PR_SET_PDEATHSIG = 4, 1
MEASURE_ENV = "CONFORMANCE_SYSCALL_MEASURE"


class _Data(ctypes.Structure):
    _fields_ = [("nr", ctypes.c_int32), ("arch", ctypes.c_uint32), ("ip", ctypes.c_uint64), ("args", ctypes.c_uint64 * 6)]


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("data", _Data)]


class _Response(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32), ("flags", ctypes.c_uint32)]


class Reporter:
    """The rank's end: ``hand_over(listener)`` once the filter is in, then ``since_last()`` after
    each task."""

    def __init__(self, arch: str):
        names = syscall_numbers.names(arch)
        measure = os.environ.get(MEASURE_ENV, "")
        libc = ctypes.CDLL(None, use_errno=True)  # before the fork: no dlopen in the child
        self._mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "fork of a multi-threaded process": the child runs only _serve
            self.pid = os.fork()
        if self.pid == 0:
            try:
                libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # before the implementation exists: no window
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                self._mine.close()
                keep = theirs.fileno()
                for name in os.listdir("/proc/self/fd"):
                    if int(name) > 2 and int(name) != keep:
                        try:
                            os.close(int(name))
                        except OSError:
                            pass
                _serve(libc, theirs, names, measure)
            finally:
                os._exit(0)
        theirs.close()
        self._pending = b""

    def hand_over(self, listener: int) -> None:
        """Give the filter's listener to the helper (the rank's copy is closed)."""
        try:
            socket.send_fds(self._mine, [b"L"], [listener])
        finally:
            os.close(listener)
        os.set_blocking(self._mine.fileno(), False)

    def stop(self) -> None:
        """No listener after all (the kernel refused one): the helper leaves."""
        self._mine.close()
        os.waitpid(self.pid, 0)

    def since_last(self) -> Counter:
        """The calls refused since the last ask: {name: times}. Read with ``read``, a call every
        filter lets through."""
        while True:
            try:
                chunk = os.read(self._mine.fileno(), 65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                break
            self._pending += chunk
        lines, _, self._pending = self._pending.rpartition(b"\n")
        return Counter(line.decode(errors="replace") for line in lines.split(b"\n") if line)

    def explain(self) -> str:
        """'' or a paragraph for a failure's text naming the calls refused since the last ask."""
        refused = self.since_last()
        if not refused:
            return ""
        calls = ", ".join(f"{name} ({count}x)" for name, count in sorted(refused.items()))
        return (
            f"\nthe contained rank's system call filter refused, with EPERM, calls outside its allow list "
            f"(harness/rank/syscall_allowlist.py: what the bundled implementations, torch.distributed and "
            f"gloo need): {calls}\n"
        )


def _serve(libc, peer: socket.socket, names: dict[int, str], measure: str) -> None:
    """The helper's loop: take the listener, then answer each call it is handed until the rank is gone."""
    try:
        _, fds, _, _ = socket.recv_fds(peer, 1, 1)
    except OSError:
        return
    if not fds:
        return
    listener = fds[0]
    seen: set[str] = set()
    record = os.path.join(measure, f"{os.getpid()}.calls") if measure else ""
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    poller.register(peer.fileno(), select.POLLIN)  # readable only at EOF: the rank is gone
    libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    while True:
        events = dict(poller.poll())
        if events.get(peer.fileno()) or events.get(listener, 0) & (select.POLLHUP | select.POLLERR):
            return
        if not events.get(listener, 0) & select.POLLIN:
            continue
        notif = _Notif()
        if libc.ioctl(listener, NOTIF_RECV, ctypes.byref(notif)) != 0:
            continue  # ENOENT: the caller was interrupted meanwhile
        name = names.get(notif.data.nr, f"system call {notif.data.nr}")
        if measure:
            if name not in seen:
                seen.add(name)
                with open(record, "a") as out:
                    out.write(name + "\n")
            answer = _Response(notif.id, 0, 0, FLAG_CONTINUE)
        else:
            try:  # named before the call returns, so the rank's next read finds it
                peer.send((name + "\n").encode(), socket.MSG_DONTWAIT)
            except OSError:
                pass  # the rank does not read (or is gone): the call is refused all the same
            answer = _Response(notif.id, 0, -1, 0)  # -EPERM
        libc.ioctl(listener, NOTIF_SEND, ctypes.byref(answer))
