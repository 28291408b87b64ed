"""The pieces of the audit's kernel evidence in a contained rank (issue 45, class 2), each on its own:
the system call filter (harness/rank/syscall_filter.py), the store socket's count
(harness/driver/socket_counters.py) and the output FIFO (harness/driver/output_pipe.py). The attacks
they stop, end to end in the emulated container: tests/test_autograder_attacks.py, class 2."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from parallelism_conformance.harness.driver import output_pipe, socket_counters
from parallelism_conformance.harness.driver.io_counters import IoCounters
from parallelism_conformance.harness.rank import syscall_filter

# Run in a child: no_new_privs, a "store" connection, the filter, then every way of moving bytes.
TRIAL = r"""
import ctypes, json, mmap, os, socket, subprocess, sys, tempfile, threading
from parallelism_conformance.harness.rank import syscall_filter
libc = ctypes.CDLL(None, use_errno=True)
server = socket.create_server(("127.0.0.1", 0))
port = server.getsockname()[1]
store = socket.create_connection(("127.0.0.1", port)); store_peer, _ = server.accept()
elsewhere = socket.create_server(("127.0.0.1", 0))
other = socket.create_connection(elsewhere.getsockname()); other_peer, _ = elsewhere.accept()
assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs, as containment.enter leaves it
fd = syscall_filter.store_descriptor(port)
assert fd == store.fileno(), (fd, store.fileno())
syscall_filter.install(fd)
outcome = {}
def attempt(name, action):
    try:
        action()
        outcome[name] = "allowed"
    except OSError as error:
        outcome[name] = f"refused {error.errno}"
unix, unix_peer = socket.socketpair()
reader, writer = os.pipe()
shared = tempfile.TemporaryFile(); shared.write(b"x" * 4096); shared.flush()
attempt("send on the store", lambda: store.send(b"x"))
attempt("write on a socket", lambda: os.write(other.fileno(), b"x"))
attempt("write on a unix socket", lambda: os.write(unix.fileno(), b"x"))
attempt("a thread", lambda: threading.Thread(target=int).start())
attempt("a private mapping of a file", lambda: mmap.mmap(shared.fileno(), 4096, flags=mmap.MAP_PRIVATE))
attempt("an anonymous shared mapping", lambda: mmap.mmap(-1, 4096))
attempt("send on another socket", lambda: other.send(b"x"))
attempt("sendmsg", lambda: other.sendmsg([b"x"]))
attempt("sendmsg on a unix socket", lambda: unix.sendmsg([b"x"]))
attempt("sendto by UDP", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", 9)))
attempt("splice", lambda: os.splice(reader, writer, 1))
attempt("sendfile", lambda: os.sendfile(other.fileno(), shared.fileno(), 0, 1))
attempt("copy_file_range", lambda: os.copy_file_range(shared.fileno(), tempfile.TemporaryFile().fileno(), 1))
attempt("fork", lambda: os.fork())
attempt("a subprocess", lambda: subprocess.run(["true"]))
attempt("a shared mapping of a file", lambda: mmap.mmap(shared.fileno(), 4096))
def sigqueue():
    if libc.sigqueue(os.getpid(), 0, ctypes.c_void_p(0)) != 0:  # signal 0: checked, never delivered
        raise OSError(ctypes.get_errno(), "sigqueue")
attempt("a signal with a value", sigqueue)
attempt("close the store", lambda: os.close(fd))
attempt("dup2 onto the store", lambda: os.dup2(other.fileno(), fd))
print(json.dumps(outcome))
"""

ALLOWED = {
    "send on the store",
    "write on a socket",
    "write on a unix socket",
    "a thread",
    "a private mapping of a file",
    "an anonymous shared mapping",
}

needs_seccomp = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"), reason="the filter is made for Linux on x86_64 and aarch64"
)


@needs_seccomp
def test_the_filter_leaves_only_channels_the_kernel_counts():
    done = subprocess.run([sys.executable, "-c", TRIAL], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.splitlines()[-1])
    assert {name for name, said in outcome.items() if said == "allowed"} == ALLOWED, outcome
    assert all(said == "refused 1" for name, said in outcome.items() if name not in ALLOWED), outcome  # EPERM


def test_the_filter_refuses_another_abi_and_x32_numbers():
    """The program's first checks: a call made under another ABI (i386's int 0x80) or with x32's
    numbers is refused before any number is compared, since those numbers mean other calls."""
    code = syscall_filter.program("x86_64", 7)
    first = [code[i : i + 8] for i in range(0, 6 * 8, 8)]
    assert first[0][:2] == b"\x20\x00" and int.from_bytes(first[0][4:], "little") == 4  # load the arch
    assert int.from_bytes(first[1][4:], "little") == 0xC000003E
    assert int.from_bytes(first[4][4:], "little") == syscall_filter.X32_SYSCALL_BIT
    assert len(syscall_filter.program("aarch64", 7)) % 8 == 0


def test_the_store_sockets_count_is_every_byte_it_sent():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    inode = os.fstat(client.fileno()).st_ino
    counters = socket_counters.TcpCounters()
    before = counters.sent({inode})[inode]  # found in a dump, then asked for by its id
    client.sendall(b"s" * 10_000)
    os.write(client.fileno(), b"w" * 100)
    received = 0
    while received < 10_100:
        received += len(peer.recv(1 << 16))
    assert counters.sent({inode})[inode] - before == 10_100
    assert counters.sent(set()) == {}
    client.close()
    peer.close()
    time.sleep(0.05)
    assert counters.sent({inode}) == {}  # closed: left out, never a stale count
    counters.close()
    server.close()


def test_a_rank_without_its_filter_or_its_store_count_fails_the_audit_closed(tmp_path):
    """Under containment, a rank whose filter was not installed has no count (None), and the reason
    says why: the audit then fails the task instead of trusting wchar alone."""
    counters = IoCounters(SimpleNamespace(uid=os.getuid(), directory=str(tmp_path)))
    me = SimpleNamespace(
        rank=0,
        attached=False,
        process=SimpleNamespace(pid=os.getpid()),
        store_socket=None,
        unfiltered="no system call filter for Linux on sparc64",
    )
    assert counters.sent([me]) == [None]
    assert "could not be installed (no system call filter for Linux on sparc64)" in counters.why_unread(me)
    counters.close()


def test_output_reaches_the_log_only_through_the_fifo_and_is_counted_as_moved(tmp_path):
    log = str(tmp_path / "rank0.log")
    pipe = output_pipe.RankPipe(log)
    pump = output_pipe.Pump([pipe])
    writer = os.open(output_pipe.fifo_path(log), os.O_WRONLY)
    with pytest.raises(OSError):  # what inflated the old log file: the FIFO has no size to grow
        os.ftruncate(writer, 1 << 24)
    big = b"z" * (3 << 20)  # more than a FIFO holds: the pump moves it while the writer blocks
    thread = threading.Thread(target=os.write, args=(writer, big))
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    with pipe.drained():
        assert os.path.getsize(log) == len(big) == pipe.moved
    os.write(writer, b"tail\n")
    deadline = time.monotonic() + 10
    while pipe.moved < len(big) + 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipe.drain() == 0 and pipe.moved == len(big) + 5
    os.close(writer)
    pump.close()
    pipe.close()
    assert not os.path.exists(output_pipe.fifo_path(log))
