"""Names the system calls a contained rank's allow list refused (harness/rank/syscall_allowlist.py),
on a channel the rank cannot rewrite, so that a test that fails on one says which call, where a bare
EPERM says nothing.

The allow list's filter answers a call outside it with SECCOMP_RET_USER_NOTIF: the kernel holds the
calling thread and hands the call to whoever holds the filter's listener. That is a helper process,
forked by the rank while still root, before containment and before any filter; it opens its record
(``<rank log>.refused``, in the driver's folder, root's), then becomes a uid of its own (not the
world's) with no capability, undumpable. Once the filter is in, the rank hands it the listener
(SCM_RIGHTS); for every call it is handed, the helper appends the call's name to its record, then
answers EPERM. The driver reads the record after each task and adds the names to a failure's text
(harness/driver/refused_calls.py).

Why the rank cannot hide a refusal: the record is root's and the rank's uid may not write it; the
helper is of another uid, so the rank can neither signal nor trace it nor read its memory; what
reaches it from the rank is a call's number and arguments, never code. Why a process and not a thread
of the rank: a thread answering would need the GIL, which the caller may hold (a C extension's call
made without releasing it), and the rank would wait on itself for ever.

Where the rank is not root (a filter tried outside containment: tests, measuring) the helper stays of
the rank's uid, and the record is only as good as the rank's restraint.

Measuring (CONFORMANCE_SYSCALL_MEASURE=<folder>): the helper lets every call it is handed go on
(SECCOMP_USER_NOTIF_FLAG_CONTINUE) and appends each new name to <folder>/<pid>.calls: how the allow
list was measured (harness/rank/syscall_measure.py).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import select
import signal
import socket
import warnings

from parallelism_conformance.harness.rank import syscall_numbers

# linux/seccomp.h: struct seccomp_notif (80 bytes) and struct seccomp_notif_resp (24 bytes)
NOTIF_RECV, NOTIF_SEND = 0xC0502100, 0xC0182101
FLAG_CONTINUE = 1
PR_SET_DUMPABLE, PR_SET_PDEATHSIG = 4, 1
MEASURE_ENV = "CONFORMANCE_SYSCALL_MEASURE"
RECORD_LIMIT = 1 << 18  # the record's size at most between the driver's reads (it empties it after each task): no disk filled
UID_LOW, UID_SPAN = 1_000_000, 1_000_000_000  # harness/rank/containment.py's range


class _Data(ctypes.Structure):
    _fields_ = [("nr", ctypes.c_int32), ("arch", ctypes.c_uint32), ("ip", ctypes.c_uint64), ("args", ctypes.c_uint64 * 6)]


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("data", _Data)]


class _Response(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32), ("flags", ctypes.c_uint32)]


class Reporter:
    """The rank's end: made before containment (``record``: the file the driver reads, or None),
    then ``hand_over(listener)`` once the filter is in. Kept for the rank's life: when its socket
    closes, the helper leaves."""

    def __init__(self, arch: str, record: str | None = None):
        names = syscall_numbers.names(arch)
        measure = os.environ.get(MEASURE_ENV, "")
        libc = ctypes.CDLL(None, use_errno=True)  # before the fork: no dlopen in the child
        # opened here, by the rank while it is root where contained: the driver's file, never the rank's
        record_fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644) if record else -1
        self._mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent = os.getpid()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "fork of a multi-threaded process": the child runs only _serve
            self.pid = os.fork()
        if self.pid == 0:
            try:
                self._mine.close()
                _close_all_but({theirs.fileno(), record_fd})
                if os.geteuid() == 0:
                    _become_a_uid_of_its_own()
                libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # after the uid change, which resets both
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if os.getppid() == parent:  # else the rank died before PDEATHSIG was set
                    _serve(libc, theirs, record_fd, names, measure)
            finally:
                os._exit(0)
        theirs.close()
        if record_fd >= 0:
            os.close(record_fd)

    def alive(self) -> bool:
        """Whether the helper still runs (it leaves where it could not drop root, say)."""
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def hand_over(self, listener: int) -> None:
        """Give the filter's listener to the helper (the rank's copy is closed). Where the helper died
        meanwhile, nobody holds it: each call off the list then fails with ENOSYS, unnamed, refused
        all the same."""
        try:
            socket.send_fds(self._mine, [b"L"], [listener])
        except OSError:
            pass
        finally:
            os.close(listener)

    def stop(self) -> None:
        """No listener after all (the kernel refused one): the helper leaves."""
        self._mine.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _close_all_but(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2 and int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:
                pass


def _become_a_uid_of_its_own() -> None:
    """Root no longer, and not the world's uid either: a rank can then neither signal it nor write its
    record. setresuid from root to another uid clears every capability (no KEEPCAPS)."""
    uid = UID_LOW + secrets.randbelow(UID_SPAN)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _serve(libc, peer: socket.socket, record_fd: int, names: dict[int, str], measure: str) -> None:
    """The helper's loop: take the listener, then answer each call it is handed until the rank is gone."""
    try:
        _, fds, _, _ = socket.recv_fds(peer, 1, 1)
    except OSError:
        return
    if not fds:
        return
    listener = fds[0]
    seen: dict[str, int] = {}
    measured = os.path.join(measure, f"{os.getpid()}.calls") if measure else ""
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
        seen[name] = seen.get(name, 0) + 1
        if measure:
            if seen[name] == 1:
                with open(measured, "a") as out:
                    out.write(name + "\n")
            answer = _Response(notif.id, 0, 0, FLAG_CONTINUE)
        else:
            try:  # written before the call returns, so the driver's read after the task finds it
                if record_fd >= 0 and os.fstat(record_fd).st_size < RECORD_LIMIT:
                    os.write(record_fd, (name + "\n").encode())
            except OSError:
                pass  # a full disk: the call is refused all the same
            answer = _Response(notif.id, 0, -1, 0)  # -EPERM
        libc.ioctl(listener, NOTIF_SEND, ctypes.byref(answer))
