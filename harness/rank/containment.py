"""Contained ranks: when the driver runs as root (a grading container), each world's ranks drop to
a user of their own before they load the implementation under test.

What that guarantees, by the kernel's permission checks rather than by anything in the rank:

* a rank cannot write the repository, the rubric or the report directory (root's files, not
  writable by others), nor signal, trace or read the memory of the driver (``/proc/<pid>/mem``
  needs ptrace access: another uid without CAP_SYS_PTRACE is refused);
* every process a rank starts, detached (``setsid``, double fork) or not, runs as the world's uid,
  so :func:`sweep` finds and kills all of them when the world is torn down or the session ends;
* a rank works in a private directory (mode 0700, its HOME too), created and removed by the driver;
* nothing can give the rank root back: its uids and gids are the sandbox's in every slot, it holds no
  capability but CAP_DAC_READ_SEARCH (and that only where the bounding set still has it), no_new_privs
  forbids any exec from granting more, and :func:`enter` checks all of it in /proc/self/status and
  refuses to go on otherwise (under Docker's default capabilities, which lack CAP_DAC_READ_SEARCH, it
  keeps none, so what it runs must be world-readable: :func:`probe` tells beforehand).

What it does not guarantee: the rank can still read files (the tests, the reference and the rubric
are readable, never writable), use the network, and write world-writable places such as /tmp while
its world lives (the sweep removes what its uid left there: harness/rank/sweeping.py). Its verdicts
do not depend on any of these (docs/grading.md, the threat model). Before it enters, a contained
process closes what it inherited from root (:func:`close_inherited`).

The uid is drawn at random from a high range per world, so worlds (and xdist workers, and
concurrent runs) never share one; it needs no /etc/passwd entry. Driver side: :func:`new_sandbox`,
:func:`sweep`, :func:`probe`, :class:`CounterReader`. Rank side: :func:`enter`.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import select
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

from parallelism_conformance.harness.rank.sweeping import reap, sweep  # noqa: F401 - the driver's side of containment, re-exported

UID_LOW, UID_SPAN = 1_000_000, 1_000_000_000  # far above any real account


@dataclass(frozen=True)
class Sandbox:
    uid: int
    directory: str  # private working directory and HOME of the world's ranks


def possible() -> bool:
    """Only root can make ranks another user."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def new_sandbox() -> Sandbox:
    """A fresh uid and a private directory it owns (driver side)."""
    uid = UID_LOW + secrets.randbelow(UID_SPAN)
    directory = tempfile.mkdtemp(prefix="conformance-rank-")
    os.chown(directory, uid, uid)
    os.chmod(directory, 0o700)
    return Sandbox(uid, directory)


def enter(sandbox: Sandbox) -> None:
    """Become the sandbox's user, in its directory, with no way back to root (rank side, before
    the implementation loads). Fails closed: raises :class:`ContainmentFailed` naming what the
    kernel refused or what is left over, and the rank then never loads the implementation.

    The order matters: the bounding set and no_new_privs while still root (dropping from the
    bounding set needs CAP_SETPCAP, which setuid takes away); then the uid change with KEEPCAPS so
    that CAP_DAC_READ_SEARCH can be kept where the bounding set still holds it; then every other
    capability cleared; then what the kernel reports is checked against what was asked."""
    libc = ctypes.CDLL(None, use_errno=True)
    keep = _kept_capabilities()
    _drop_bounding_set(libc, keep)
    _prctl(libc, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, what="clear the ambient capabilities")
    # no setuid-root program, file capability or LSM transition can raise this process or its children
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1, what="set no_new_privs")
    _become(libc, sandbox.uid, keep)
    # Changing credentials made the rank undumpable, which would hide /proc/<pid>/io from the driver
    # when it lacks CAP_SYS_PTRACE; dumpable lets a reader of the same uid see the kernel's counts.
    _prctl(libc, PR_SET_DUMPABLE, 1, what="make the rank's /proc entries readable by its own uid")
    problems = leftover_privileges(_read_status(), sandbox.uid, allowed=keep)
    if problems:
        raise ContainmentFailed("the contained rank still holds privileges, so it could become root again: " + "; ".join(problems))
    os.umask(0o077)
    sys.path[:] = [os.path.abspath(entry) for entry in sys.path]  # '' meant the directory being left
    os.chdir(sandbox.directory)
    os.environ["HOME"] = sandbox.directory
    os.environ["TMPDIR"] = sandbox.directory


def _become(libc, uid: int, keep: int) -> None:
    """setuid to ``uid`` in every slot (gids alike, no supplementary group), keeping the
    capabilities ``keep`` in the permitted and effective sets and nothing else."""
    _prctl(libc, PR_SET_KEEPCAPS, 1, what="keep capabilities across setuid")
    try:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    except OSError as error:
        raise ContainmentFailed(
            f"could not switch the rank to uid {uid} ({error}); run with --contain-ranks no where the container cannot map other uids"
        ) from error
    _prctl(libc, PR_SET_KEEPCAPS, 0, what="stop keeping capabilities across setuid")
    _set_capabilities(libc, keep)


class ContainmentFailed(PermissionError):
    """The rank could not be contained; the implementation under test must not run in it."""


PR_SET_DUMPABLE = 4
PR_SET_KEEPCAPS = 8
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CAP_DAC_READ_SEARCH = 2
CAP_SYS_PTRACE = 19
_CAPABILITY_VERSION_3 = 0x20080522
_CAPABILITY_SETS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")


def _prctl(libc, option: int, *args: int, what: str) -> None:
    padded = (list(args) + [0, 0, 0, 0])[:4]
    if libc.prctl(option, *padded) != 0:
        error = ctypes.get_errno()
        raise ContainmentFailed(f"could not {what}: prctl({option}) failed with {os.strerror(error)}")


def _kept_capabilities() -> int:
    """CAP_DAC_READ_SEARCH where this process may keep it (a Python under a private home such as
    /root still imports its standard library), else nothing."""
    return (1 << CAP_DAC_READ_SEARCH) if _has_capability(CAP_DAC_READ_SEARCH) else 0


def _has_capability(capability: int) -> bool:
    """Whether this process's permitted and bounding sets hold ``capability`` (a container may lack it)."""
    status = _read_status()
    return all(int(status.get(key, "0"), 16) >> capability & 1 for key in ("CapPrm", "CapBnd"))


def _drop_bounding_set(libc, keep: int) -> None:
    """Drop every capability but ``keep`` from the bounding set. Without CAP_SETPCAP (a container
    may withhold it) the set stays; no_new_privs and an empty permitted set still close every way
    back, and :func:`leftover_privileges` checks those."""
    highest = int(open("/proc/sys/kernel/cap_last_cap").read()) if os.path.exists("/proc/sys/kernel/cap_last_cap") else 40
    for capability in range(highest + 1):
        if not keep >> capability & 1 and libc.prctl(PR_CAPBSET_READ, capability, 0, 0, 0) == 1:
            libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)  # refused without CAP_SETPCAP: see above


def _set_capabilities(libc, keep: int) -> None:
    """Permitted and effective sets become ``keep``, inheritable empty. Lowering is always allowed,
    so a refusal here means something else is wrong, and the rank stops."""
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)(keep & 0xFFFFFFFF, keep & 0xFFFFFFFF, 0, keep >> 32, keep >> 32, 0)
    if libc.capset(header, data) != 0:
        error = ctypes.get_errno()
        raise ContainmentFailed(f"capset to {keep:#x} failed with {os.strerror(error)}")


def _read_status() -> dict[str, str]:
    with open("/proc/self/status") as status:
        return dict(line.rstrip("\n").split(":\t", 1) for line in status if ":\t" in line)


def leftover_privileges(status: dict[str, str], uid: int, allowed: int = 0) -> list[str]:
    """What in a process's /proc/<pid>/status (``status``: field -> text) could give it root back:
    a real, effective, saved or filesystem uid or gid other than ``uid``, a supplementary group, a
    capability outside ``allowed`` in its inheritable, permitted, effective or ambient set, or
    no_new_privs unset. The bounding set only limits what an exec may grant, which no_new_privs
    already forbids, so it is not required to be empty. [] when contained."""
    problems = []
    for field in ("Uid", "Gid"):
        ids = [int(value) for value in status.get(field, "").split()]
        if not ids or any(value != uid for value in ids):
            problems.append(f"{field} is {status.get(field, '?').split()} (expected {uid} in every slot)")
    if status.get("Groups", "").split():
        problems.append(f"supplementary groups {status['Groups'].split()}")
    for key in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        extra = int(status.get(key, "0"), 16) & ~allowed
        if extra:
            problems.append(f"{key} {extra:#x} beyond the allowed {allowed:#x}")
    if status.get("NoNewPrivs", "0").strip() != "1":
        problems.append("no_new_privs is not set")
    return problems


def probe(paths: list[str]) -> str | None:
    """Can ranks be contained here, and can a contained rank still read ``paths`` (the Python it
    runs, the suite, the implementation under test)? Driver side: a forked child enters a fresh
    sandbox and tries, so nothing is exec'd and the check costs one fork. None when it works,
    else the reason, for the grading profile to refuse with."""
    sandbox = new_sandbox()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: contain itself, try each path, report one line, never return
        os.close(read_end)
        message = b""
        try:
            close_inherited({write_end})
            enter(sandbox)
            for path in paths:
                if os.path.isdir(path):
                    os.listdir(path)
                else:
                    open(path, "rb").close()
        except BaseException as error:  # noqa: BLE001 - whatever went wrong is the probe's answer
            message = f"{type(error).__name__}: {error}".encode()
        os.write(write_end, message[:4000])
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        message = answer.read().decode(errors="replace")
    reap(pid, 60.0)
    sweep(sandbox)
    if not message:
        return None
    hint = (
        " (a contained rank keeps no capability here, so what it runs must be world-readable: install "
        "Python and the suite outside a private home such as /root, as the autograder's setup.sh does)"
        if "Permission" in message and not _has_capability(CAP_DAC_READ_SEARCH)
        else ""
    )
    return message + hint


class CounterReader:
    """Reads processes' /proc/<pid>/io counters as ``uid``, for a driver without CAP_SYS_PTRACE (a
    container's default capabilities): the kernel shows a process's counters only to a reader that
    may trace it, so a child of the ranks' uid and capabilities reads them for the driver.

    One child per world, asked over a pipe: the deadlock watch reads every 0.2 s and the audit before
    and after every task, and a fork of the driver per read cost 9.6 s of a 21 s audit run (1048
    forks). The child is undumpable (changing uid already makes it so where fs.suid_dumpable is 0;
    it asks again for hosts that set it otherwise), so a rank of the same uid can neither trace it
    nor read its memory; a rank that kills or stops it only makes every count unreadable (None)
    after ANSWER_TIMEOUT_S, which fails that rank's audit rather than hiding anything."""

    ANSWER_TIMEOUT_S = 5.0

    def __init__(self, uid: int):
        libc, keep = ctypes.CDLL(None, use_errno=True), _kept_capabilities()  # before the fork: no dlopen in the child
        request_read, self._requests = os.pipe()
        self._answers, answer_write = os.pipe()
        self.pid: int | None = os.fork()
        if self.pid == 0:
            try:
                _close_all_but({request_read, answer_write})  # the driver's sockets and pipes stay the driver's
                _become(libc, uid, keep)
                _prctl(libc, PR_SET_DUMPABLE, 0, what="make the counter reader undumpable")
                _serve_counter_requests(request_read, answer_write)
            finally:  # the child must never return into the driver's code
                os._exit(0)
        os.close(request_read)
        os.close(answer_write)
        self._pending = b""

    def read(self, pids: list[int]) -> list[dict[str, int] | None]:
        """Each pid's counters, in order; None where unreadable (gone, undumpable, or no reader)."""
        if self.pid is None or not pids:
            return [None] * len(pids)
        try:
            os.write(self._requests, (" ".join(map(str, pids)) + "\n").encode())
            deadline = time.monotonic() + self.ANSWER_TIMEOUT_S
            while b"\n" not in self._pending:
                ready, _, _ = select.select([self._answers], [], [], max(0.0, deadline - time.monotonic()))
                chunk = os.read(self._answers, 65536) if ready else b""
                if not chunk:  # stopped, killed or timed out: no reader from here on
                    self.close()
                    return [None] * len(pids)
                self._pending += chunk
        except OSError:
            self.close()
            return [None] * len(pids)
        line, self._pending = self._pending.split(b"\n", 1)
        entries = line.decode().split("\t")
        entries += ["-"] * (len(pids) - len(entries))
        return [parse_io_counters(entry) for entry in entries[: len(pids)]]

    def close(self) -> None:
        if self.pid is None:
            return
        for fd in (self._requests, self._answers):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.pid = None


def close_inherited(keep: set[int] = frozenset()) -> None:
    """Close every descriptor but stdin, stdout, stderr and ``keep`` (contained side, before the code
    under test runs). A rank is forked from multiprocessing's forkserver and the precheck's child from
    the driver, both root: what they inherit is root's (the resource tracker's pipe, which unlinks as
    root any /dev/shm name written to it; the forkserver's pipes; the driver's own). Closed, none of it
    is reachable: another uid cannot reopen a root process's pipe through /proc. The resource tracker's
    number is forgotten too, so nothing writes to whatever later reuses it (a register would start a
    tracker of the sandbox's own uid, swept with the world)."""
    _close_all_but(set(keep))
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    if tracker is not None:
        tracker._resource_tracker._fd = None
        tracker._resource_tracker._pid = None


def _close_all_but(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _serve_counter_requests(requests: int, answers: int) -> None:
    """The reader's loop: one line of pids in, one line out (each pid's counters as
    "rchar 1 wchar 2 ...", or "-", tab-separated); ends when the driver closes the pipe."""
    pending = b""
    while True:
        chunk = os.read(requests, 65536)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            entries = []
            for pid in line.split():
                try:
                    with open(f"/proc/{int(pid)}/io") as io:
                        entries.append(" ".join(row.replace(":", "").strip() for row in io))
                except (OSError, ValueError):
                    entries.append("-")
            os.write(answers, ("\t".join(entries) + "\n").encode())


def parse_io_counters(line: str) -> dict[str, int] | None:
    """ "rchar 1 wchar 2 ..." (the child's one-line form of /proc/<pid>/io) -> {"rchar": 1, ...}."""
    words = line.split()
    if len(words) < 2 or len(words) % 2:
        return None
    try:
        return {words[i]: int(words[i + 1]) for i in range(0, len(words), 2)}
    except ValueError:
        return None
