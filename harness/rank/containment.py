"""Contained ranks: when the driver runs as root (a grading container), each world's ranks drop to
a user of their own before they load the implementation under test.

What that guarantees, by the kernel's permission checks rather than by anything in the rank:

* a rank cannot write the repository, the rubric or the report directory (root's files, not
  writable by others), nor signal, trace or read the memory of the driver (``/proc/<pid>/mem``
  needs ptrace access: another uid without CAP_SYS_PTRACE is refused);
* every process a rank starts, detached (``setsid``, double fork) or not, runs as the world's uid,
  so :func:`sweep` finds and kills all of them when the world is torn down or the session ends;
* a rank works in a private directory (mode 0700, its HOME too), created and removed by the driver.

What it does not guarantee: the rank can still read files (it keeps CAP_DAC_READ_SEARCH, so that a
Python under a private home still imports its standard library: the tests, the reference and the
rubric are readable, never writable), use the network, and write world-writable places such as /tmp. Its verdicts do not
depend on any of these (see docs/threat-model.md).

The uid is drawn at random from a high range per world, so worlds (and xdist workers, and
concurrent runs) never share one; it needs no /etc/passwd entry. Driver side: :func:`new_sandbox`,
:func:`sweep`. Rank side: :func:`enter`.
"""
from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass

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
    """Become the sandbox's user, in its directory (rank side, before the implementation loads).
    Raises PermissionError with the cause when the kernel refuses (e.g. a user namespace whose
    uid map does not hold the uid)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)  # keep the permitted capabilities across setuid, to pick one
    try:
        os.setgroups([])
        os.setgid(sandbox.uid)
        os.setuid(sandbox.uid)
    except OSError as error:
        raise PermissionError(f"could not switch the rank to uid {sandbox.uid} ({error}); run with "
                              "--contain-ranks no where the container cannot map other uids") from error
    libc.prctl(PR_SET_KEEPCAPS, 0, 0, 0, 0)
    _keep_only_read_search(libc)
    os.umask(0o077)
    sys.path[:] = [os.path.abspath(entry) for entry in sys.path]  # '' meant the directory being left
    os.chdir(sandbox.directory)
    os.environ["HOME"] = sandbox.directory
    os.environ["TMPDIR"] = sandbox.directory


PR_SET_KEEPCAPS = 8
CAP_DAC_READ_SEARCH = 2
_CAPABILITY_VERSION_3 = 0x20080522


def _keep_only_read_search(libc) -> None:
    """Of root's capabilities keep CAP_DAC_READ_SEARCH alone (effective and permitted; none
    inheritable): the rank may read and search any file, so a Python installed under a private
    home (/root/.pyenv, mode 0700) still imports its standard library, but it writes only where
    its uid may, and reading another process's memory needs CAP_SYS_PTRACE, which it has not."""
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)(1 << CAP_DAC_READ_SEARCH, 1 << CAP_DAC_READ_SEARCH, 0, 0, 0, 0)
    libc.capset(header, data)  # on failure the rank simply has no capability left


def sweep(sandbox: Sandbox) -> None:
    """Kill every process running as the sandbox's uid, then remove its directory (driver side).
    kill(-1) as that uid reaches exactly the processes that uid owns: the ranks and whatever they
    started, detached or not. A forked child does it (no exec: the sandbox's uid may not be allowed
    to run this Python, e.g. one under /root)."""
    pid = os.fork()
    if pid == 0:  # only system calls between fork and _exit
        code = 0
        try:
            os.setgroups([])
            os.setgid(sandbox.uid)
            os.setuid(sandbox.uid)
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing of that uid is left
        except BaseException:  # noqa: BLE001 - the child must never return into the driver's code
            code = 1
        os._exit(code)
    os.waitpid(pid, 0)
    shutil.rmtree(sandbox.directory, ignore_errors=True)
