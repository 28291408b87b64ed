"""A filter that allows, layered under the one that forbids (issue 58, item 2): once a contained rank
has joined its world, and before the implementation loads, it may make only the system calls its
task needs; every other call fails with EPERM and is named in the failure (harness/rank/refusal_reporter.py).

harness/rank/syscall_filter.py refuses a list of calls the kernel's write count misses, with rules on
arguments (``sendto`` on the store socket only, threads only, no shared file mapping, the store's
descriptor kept). A list of refusals is only as good as its author's imagination: the issue found
message queues (``mq_open``) and keys (``add_key``) outliving the sweep, and file systems carry data
in link targets, extended attributes and names. This filter is installed first, and the kernel runs
both on every call, the stricter answer winning (an EPERM of the deny list beats anything here),
so the deny list's rules all still hold, and anything new must first be measured into ALLOWED.

ALLOWED was measured on x86_64 (Linux 6.18, torch 2.x, gloo, Python 3.11) by
harness/rank/syscall_measure.py: the helper lets every call through and writes down its name
(refusal_reporter, CONFORMANCE_SYSCALL_MEASURE), starting from HARNESS alone, over a process doing
what honest Python in an implementation does (a thread, a file, a clock: syscall_measure.ORDINARY)
and the contained conformance runs of the bundled implementations (every file: 237 tests),
torch.distributed and the CS336 set (tests/fixtures/cs336_submission)::

    python -m parallelism_conformance.harness.rank.syscall_measure -- conformance -p no:randomly \
        --hypothesis-profile=second_opinion --impl parallelism_conformance.impls   # then torch.distributed;
    CS336_SUBMISSION=tests/fixtures/cs336_submission python -m ...syscall_measure -- conformance \
        --hypothesis-profile=second_opinion --impl parallelism_conformance.adapters.cs336 --scope cs336 \
        --capability data_parallel,sharded_optimizer,fully_sharded

aarch64 takes the same names, those x86_64 alone has mapped to their generic equivalents
(syscall_numbers.GENERIC_EQUIVALENTS): not measured there. Elsewhere the filter is unavailable, and
the rank says so (syscall_filter.counted_channels), as for the deny list.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

from parallelism_conformance.harness.rank import syscall_numbers
from parallelism_conformance.harness.rank.refusal_reporter import MEASURE_ENV, Reporter

# What the handing over of the listener needs between this filter and the helper's first answer
# (a call outside the list then would wait for a helper that cannot answer yet): always allowed.
HARNESS = (
    "sendmsg",
    "close",
    "futex",
    "brk",
    "mmap",
    "munmap",
    "mprotect",
    "madvise",
    "mremap",
    "seccomp",
    "rt_sigprocmask",
    "getpid",
    "gettid",
    "read",
    "write",
    "fcntl",
    "exit",
    "exit_group",
)

# measured: see the module's docstring; one name per call, sorted
ALLOWED = (
    "accept",
    "arch_prctl",
    "clock_nanosleep",
    "clone",
    "clone3",
    "connect",
    "epoll_ctl",
    "epoll_wait",
    "getcwd",
    "getdents64",
    "getpeername",
    "getrandom",
    "getsockname",
    "getsockopt",
    "ioctl",
    "kill",
    "lseek",
    "mkdir",
    "newfstatat",
    "openat",
    "poll",
    "prctl",
    "readlink",
    "recvfrom",
    "rmdir",
    "rseq",
    "rt_sigaction",
    "sched_yield",
    "sendto",
    "set_robust_list",
    "setsockopt",
    "socket",
    "stat",
    "uname",
    "unlink",
    "unlinkat",
    "writev",
)

SWITCH_ENV = "CONFORMANCE_SYSCALL_ALLOWLIST"  # "off": perf/test_syscall_allowlist_overhead.py's baseline, never trusted by the audit
SEED_ENV = "CONFORMANCE_SYSCALL_SEED"  # "harness": measure from HARNESS alone, else from ALLOWED too

_LD_W_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _ERRNO, _USER_NOTIF = 0x7FFF0000, 0x00050000, 0x7FC00000
_EPERM = 1
X32_SYSCALL_BIT = 0x40000000
_AUDIT_ARCH = {"x86_64": (0xC000003E, 317), "aarch64": (0xC00000B7, 277)}

SECCOMP_SET_MODE_FILTER = 1
FLAG_TSYNC, FLAG_NEW_LISTENER, FLAG_TSYNC_ESRCH = 1, 1 << 3, 1 << 4


class AllowListUnavailable(RuntimeError):
    """The allow list could not be installed: the rank reports its filter incomplete."""


def allowed_numbers(arch: str, names: tuple[str, ...]) -> list[int]:
    """The numbers of ``names`` on ``arch``, x86_64-only names taken as their generic equivalents."""
    numbers = syscall_numbers.numbers(arch)
    found = set()
    for name in names:
        if arch != "x86_64" and name not in numbers:
            name = syscall_numbers.GENERIC_EQUIVALENTS.get(name)
        if name in numbers:
            found.add(numbers[name])
    return sorted(found)


def program(arch: str, allowed: list[int], otherwise: int) -> bytes:
    """Allow ``allowed`` (numbers), answer anything else with ``otherwise`` (a SECCOMP_RET_* value).
    Straight-line: on kernels from 5.11 the kernel caches a call this program always allows, so an
    allowed call costs no BPF at all; before, a comparison per entry."""
    audit_arch, _ = _AUDIT_ARCH[arch]
    code = [(_LD_W_ABS, 0, 0, 4), (_JEQ, 1, 0, audit_arch), (_RET, 0, 0, _ERRNO | _EPERM), (_LD_W_ABS, 0, 0, 0)]
    if arch == "x86_64":
        code += [(_JGE, 0, 1, X32_SYSCALL_BIT), (_RET, 0, 0, _ERRNO | _EPERM)]
    for number in allowed:
        code += [(_JEQ, 0, 1, number), (_RET, 0, 0, _ALLOW)]
    code.append((_RET, 0, 0, otherwise))
    return b"".join(struct.pack("HBBI", op, jt, jf, k) for op, jt, jf, k in code)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _seccomp(arch: str, code: bytes, flags: int) -> tuple[int, int]:
    """(the kernel's answer, errno)."""
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    found = libc.syscall(ctypes.c_long(_AUDIT_ARCH[arch][1]), ctypes.c_long(SECCOMP_SET_MODE_FILTER), ctypes.c_long(flags), ctypes.byref(fprog))
    return found, ctypes.get_errno()


def install(reporter: Reporter | None = None) -> Reporter | None:
    """Install the allow list on every thread of this process (no_new_privs set), before
    syscall_filter.install; ``reporter`` names refused calls (made before containment, where the
    rank is root: harness/rank/loop.py), else one is made here. Returns the reporter, to be kept for
    the process's life, or None where the kernel has no listener for filters (before 5.7 with
    threads): refused calls then fail with EPERM unnamed. Raises AllowListUnavailable where no filter
    can be installed."""
    arch = platform.machine()
    if arch not in _AUDIT_ARCH or not os.path.exists("/proc/self/status"):
        raise AllowListUnavailable(f"no system call allow list for {platform.system()} on {arch} (Linux on x86_64 or aarch64 only)")
    measuring = bool(os.environ.get(MEASURE_ENV))
    names = HARNESS if measuring and os.environ.get(SEED_ENV) == "harness" else HARNESS + ALLOWED
    allowed = allowed_numbers(arch, names)
    if reporter is None:
        try:
            reporter = Reporter(arch)
        except OSError:
            reporter = None
    if reporter is not None and not reporter.alive():
        reporter = None  # a listener nobody would answer: refusals stay EPERM, unnamed
    if reporter is not None:
        found, error = _seccomp(arch, program(arch, allowed, _USER_NOTIF), FLAG_TSYNC | FLAG_NEW_LISTENER | FLAG_TSYNC_ESRCH)
        if found >= 0:
            reporter.hand_over(found)
            return reporter
        reporter.stop()
        if measuring:
            raise AllowListUnavailable(f"cannot measure: the kernel gave no listener ({os.strerror(error)})")
    found, error = _seccomp(arch, program(arch, allowed, _ERRNO | _EPERM), FLAG_TSYNC)
    if found != 0:
        why = f"thread {found} could not take it" if found > 0 else os.strerror(error)
        raise AllowListUnavailable(f"the kernel refused the system call allow list: {why}")
    return None


def reporter_for(log_path: str | None) -> Reporter | None:
    """The helper that names this rank's refused calls, in the file the driver reads
    (harness/driver/refused_calls.py), made before containment; None where no filter can be made."""
    if platform.machine() not in _AUDIT_ARCH or not log_path:
        return None
    try:
        return Reporter(platform.machine(), refused_path(log_path))
    except OSError:
        return None


def refused_path(log_path: str) -> str:
    return log_path.removesuffix(".log") + ".refused"
