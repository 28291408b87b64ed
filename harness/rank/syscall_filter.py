"""Counted channels: a contained rank moves bytes to another process only through system calls the
kernel counts, so that the audit's kernel evidence (harness/driver/audit.py: accounted) cannot be
dodged.

The kernel counts what a process writes (/proc/<pid>/io wchar) in ``write``, ``writev``,
``pwrite64`` and ``pwritev``, whatever the descriptor is (file, pipe, FIFO, TCP, UDP or Unix
socket). It does not count ``sendto``, ``sendmsg`` or ``sendmmsg``, nor ``splice``, ``vmsplice``,
``tee``, ``sendfile`` or ``copy_file_range``, nor asynchronous writes (io_uring, Linux AIO), nor a
System V or POSIX message (measured: docs/grading.md). A seccomp filter, installed with no_new_privs
before the implementation loads and on every thread of the rank at once (TSYNC), refuses those calls
with EPERM; a filter cannot be removed, by root or anyone, and every thread and child inherits it.

Two exceptions keep torch working, each counted another way:

* ``sendto`` on the one descriptor of the rank's TCPStore connection (torch sends its requests with
  ``send``): the driver counts that socket's bytes from the kernel's TCP statistics
  (harness/driver/socket_counters.py). ``close``, ``dup2`` and ``dup3`` cannot retire or replace
  that descriptor, so what goes out under its number is always that socket's.
* ``clone`` of a thread (CLONE_THREAD): a thread's writes are counted in its process. A new process
  is refused (``fork``, ``vfork``, ``clone`` without CLONE_THREAD): a child's writes are counted in
  the parent only once the parent reaps it, and a child that outlives the task is counted nowhere.
  ``clone3`` answers ENOSYS, on which the C library falls back to ``clone`` for threads.

Also refused, as channels that move bytes between processes with nobody writing: memory shared with
another process (``mmap`` of a file with MAP_SHARED, a file in /dev/shm or a memfd among them, and
System V ``shmat``), ``process_vm_readv`` and ``process_vm_writev``, ``ptrace``, and a signal that
carries a value (``rt_sigqueueinfo``, ``rt_tgsigqueueinfo``, ``pidfd_send_signal``: 8 bytes a call). What stays out
of reach: a rank that reads another's memory through /proc/<pid>/mem (a ``read``, which counts
nothing for the rank read from): ranks of one uid pass the kernel's ptrace-access check, which the
driver's own reader of the ranks' /proc/<pid>/io needs too (docs/grading.md).

Under this filter lies another, installed first: the allow list of the calls a rank's task needs
(harness/rank/syscall_allowlist.py), which refuses, and names, every call not measured into it. The
kernel runs both, the stricter answer winning, so each refusal here holds whatever the list says.

Linux on x86_64 and aarch64 only; elsewhere :func:`install` raises :class:`FilterUnavailable`, and
the rank reports that the audit's evidence is incomplete rather than running unfiltered.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from datetime import timedelta

from parallelism_conformance.harness.rank import syscall_allowlist


def counted_channels(store_port: int, backend: str, reporter=None) -> tuple[int | None, str]:
    """A contained rank's filters, installed once the world is joined and before the implementation
    loads (harness/rank/loop.py: serve): the allow list (harness/rank/syscall_allowlist.py, its
    refusals named by ``reporter``), then this module's refusals. Returns the inode of the store
    connection it may still send on, and ''; or None and why they could not be installed (the driver
    then fails the audit, saying so)."""
    if backend not in ("gloo", "relay"):  # the relay's connection is written with writev: counted
        return None, f"not made for {backend} ranks (their backend's own sockets send with send)"
    try:
        store_fd = store_descriptor(store_port)
        _groups_share_one_gloo_device()
        if os.environ.get(syscall_allowlist.SWITCH_ENV) == "off":  # the cost benchmark's: the audit then fails
            install(store_fd)
            return None, f"the system call allow list was switched off ({syscall_allowlist.SWITCH_ENV}=off)"
        syscall_allowlist.install(reporter)
        install(store_fd)
        return socket_inode(store_fd), ""
    except (FilterUnavailable, syscall_allowlist.AllowListUnavailable, OSError) as error:
        return None, str(error)


def _groups_share_one_gloo_device() -> None:
    """Every gloo group made from now on uses one device (one listening address), made here: torch
    makes a device per group, and finding its address asks the kernel through a netlink socket's
    sendto, which the filter refuses. The device is made as torch makes it (GLOO_SOCKET_IFNAME's
    interfaces, else the default), so the transport, and every byte sent, is the same."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    gloo = getattr(dist, "ProcessGroupGloo", None)
    if gloo is None:
        return
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    devices = [gloo.create_device(interface=name) for name in interfaces] if interfaces else [gloo.create_default_device()]

    class OnOneDevice(gloo):
        def __init__(self, store, rank, size, timeout=timedelta(minutes=30)):
            if isinstance(timeout, gloo._Options):
                super().__init__(store, rank, size, timeout)
                return
            options = gloo._Options()
            options._devices, options._timeout, options._threads = devices, timeout, 2 * len(devices)
            super().__init__(store, rank, size, options)

    dist.ProcessGroupGloo = distributed_c10d.ProcessGroupGloo = OnOneDevice


# architecture -> (AUDIT_ARCH_*, the seccomp system call, {name: number})
_ARCHES = {
    "x86_64": (
        0xC000003E,
        317,
        {
            "close": 3,
            "dup2": 33,
            "dup3": 292,
            "sendto": 44,
            "sendmsg": 46,
            "sendmmsg": 307,
            "clone": 56,
            "clone3": 435,
            "fork": 57,
            "vfork": 58,
            "splice": 275,
            "tee": 276,
            "vmsplice": 278,
            "sendfile": 40,
            "copy_file_range": 326,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "io_setup": 206,
            "io_submit": 209,
            "ptrace": 101,
            "msgsnd": 69,
            "mq_timedsend": 242,
            "shmat": 30,
            "mmap": 9,
            "rt_sigqueueinfo": 129,
            "rt_tgsigqueueinfo": 297,
            "pidfd_send_signal": 424,
        },
    ),
    "aarch64": (
        0xC00000B7,
        277,
        {
            "close": 57,
            "dup3": 24,
            "sendto": 206,
            "sendmsg": 211,
            "sendmmsg": 269,
            "clone": 220,
            "clone3": 435,
            "splice": 76,
            "tee": 77,
            "vmsplice": 75,
            "sendfile": 71,
            "copy_file_range": 285,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "io_setup": 0,
            "io_submit": 2,
            "ptrace": 117,
            "msgsnd": 189,
            "mq_timedsend": 182,
            "shmat": 196,
            "mmap": 222,
            "rt_sigqueueinfo": 138,
            "rt_tgsigqueueinfo": 240,
            "pidfd_send_signal": 424,
        },
    ),
}
REFUSED = (
    "sendmsg",
    "sendmmsg",
    "splice",
    "tee",
    "vmsplice",
    "sendfile",
    "copy_file_range",
    "process_vm_readv",
    "process_vm_writev",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "io_setup",
    "io_submit",
    "ptrace",
    "fork",
    "vfork",
    "msgsnd",
    "mq_timedsend",
    "shmat",
    "rt_sigqueueinfo",
    "rt_tgsigqueueinfo",
    "pidfd_send_signal",
)
CLONE_THREAD = 0x00010000
MAP_SHARED, MAP_ANONYMOUS = 0x01, 0x20
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers

# classic BPF (linux/filter.h, linux/seccomp.h)
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data


def _arg(index: int) -> int:
    """Offset of the low 32 bits of argument ``index`` (little-endian)."""
    return 16 + 8 * index


class FilterUnavailable(RuntimeError):
    """The filter could not be installed here: the audit's kernel evidence would be incomplete."""


class _Program:
    """A straight-line BPF program; each check jumps over its own refusal."""

    def __init__(self):
        self.code: list[tuple[int, int, int, int]] = []

    def op(self, code: int, k: int, jt: int = 0, jf: int = 0) -> None:
        self.code.append((code, jt, jf, k))

    def refuse_if_arg(self, number: int, index: int, value: int, errno: int = _EPERM) -> None:
        """Calls ``number`` whose argument ``index`` is ``value`` (as a 32-bit descriptor) fail."""
        self.op(_JEQ, number, 0, 3)
        self.op(_LD_W_ABS, _arg(index))
        self.op(_JEQ, value, 0, 1)
        self.op(_RET, _ERRNO | errno)
        self.op(_LD_W_ABS, _NR)  # reload for the checks after


def program(arch: str, store_fd: int) -> bytes:
    """The filter for ``arch`` (a platform.machine() name), ``store_fd`` the TCPStore descriptor."""
    audit_arch, _, numbers = _ARCHES[arch]
    p = _Program()
    p.op(_LD_W_ABS, _ARCH)
    p.op(_JEQ, audit_arch, 1, 0)
    p.op(_RET, _ERRNO | _EPERM)  # another ABI (i386's int 0x80 on x86_64): its numbers differ
    p.op(_LD_W_ABS, _NR)
    if arch == "x86_64":
        p.op(_JGE, X32_SYSCALL_BIT, 0, 1)
        p.op(_RET, _ERRNO | _EPERM)
    for name in REFUSED:
        if name in numbers:
            p.op(_JEQ, numbers[name], 0, 1)
            p.op(_RET, _ERRNO | _EPERM)
    p.op(_JEQ, numbers["clone3"], 0, 1)
    p.op(_RET, _ERRNO | _ENOSYS)
    # sendto: only on the store's descriptor
    p.op(_JEQ, numbers["sendto"], 0, 5)
    p.op(_LD_W_ABS, _arg(0) + 4)
    p.op(_JEQ, 0, 0, 2)
    p.op(_LD_W_ABS, _arg(0))
    p.op(_JEQ, store_fd, 1, 0)
    p.op(_RET, _ERRNO | _EPERM)
    p.op(_LD_W_ABS, _NR)
    # clone: threads only
    p.op(_JEQ, numbers["clone"], 0, 3)
    p.op(_LD_W_ABS, _arg(0))
    p.op(_JSET, CLONE_THREAD, 1, 0)
    p.op(_RET, _ERRNO | _EPERM)
    p.op(_LD_W_ABS, _NR)
    # mmap: no file shared (an anonymous shared mapping is shared with children only, and there are none)
    p.op(_JEQ, numbers["mmap"], 0, 4)
    p.op(_LD_W_ABS, _arg(3))
    p.op(_JSET, MAP_ANONYMOUS, 2, 0)
    p.op(_JSET, MAP_SHARED, 0, 1)
    p.op(_RET, _ERRNO | _EPERM)
    p.op(_LD_W_ABS, _NR)
    # the store's descriptor cannot be closed or replaced
    p.refuse_if_arg(numbers["close"], 0, store_fd)
    for name in ("dup2", "dup3"):
        if name in numbers:
            p.refuse_if_arg(numbers[name], 1, store_fd)
    p.op(_RET, _ALLOW)
    return b"".join(struct.pack("HBBI", *instruction) for instruction in p.code)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC = 1


def install(store_fd: int) -> None:
    """Install the filter on every thread of this process (no_new_privs must be set: containment.enter).
    Raises FilterUnavailable naming why where it cannot."""
    arch = platform.machine()
    if arch not in _ARCHES or not os.path.exists("/proc/self/status"):
        raise FilterUnavailable(f"no system call filter for {platform.system()} on {arch} (Linux on x86_64 or aarch64 only)")
    code = program(arch, store_fd)
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    found = libc.syscall(
        ctypes.c_long(_ARCHES[arch][1]), ctypes.c_long(SECCOMP_SET_MODE_FILTER), ctypes.c_long(SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(fprog)
    )
    if found != 0:
        error = ctypes.get_errno()
        why = f"thread {found} could not take it" if found > 0 else os.strerror(error)
        raise FilterUnavailable(f"the kernel refused the system call filter: {why}")


def store_descriptor(port: int) -> int:
    """This process's descriptor of its TCP connection to the store's ``port`` (the one socket whose
    ``send`` the filter lets through): found by the socket's inode in /proc/net/tcp{,6}."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":  # ESTABLISHED
                        inodes.add(fields[9])
        except FileNotFoundError:
            continue
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            found.append(int(name))
    if len(found) != 1:
        raise FilterUnavailable(f"found {len(found)} connections to the store's port {port} in this rank, not one")
    return found[0]


def socket_inode(fd: int) -> int:
    """The inode of the socket behind ``fd``: what the driver looks up in the kernel's TCP table."""
    target = os.readlink(f"/proc/self/fd/{fd}")
    return int(target[len("socket:[") : -1])
