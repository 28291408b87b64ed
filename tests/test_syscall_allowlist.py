"""The allow list of a contained rank's system calls (issue 58, item 2): harness/rank/syscall_allowlist.py
layered under harness/rank/syscall_filter.py. A call outside the list fails with EPERM and is named
(harness/rank/refusal_reporter.py); the deny list's rules still hold under it; and the bundled
implementations and torch.distributed still pass contained (end to end, in the emulated grading
container: tests/test_autograder_attacks.py, class 7)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from parallelism_conformance.harness.rank import syscall_allowlist, syscall_numbers

# Run in a child: no_new_privs, a "store" connection, both filters, then calls on and off the list.
TRIAL = r"""
import ctypes, json, os, socket, sys, threading
from parallelism_conformance.harness.rank import refusal_reporter, syscall_allowlist, syscall_filter, syscall_numbers
record = sys.argv[1]
reporter = refusal_reporter.Reporter(os.uname().machine, record)  # where a rank makes it: before containment
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
server = socket.create_server(("127.0.0.1", 0))
port = server.getsockname()[1]
store = socket.create_connection(("127.0.0.1", port)); store_peer, _ = server.accept()
elsewhere = socket.create_server(("127.0.0.1", 0))
other = socket.create_connection(elsewhere.getsockname()); other_peer, _ = elsewhere.accept()
numbers = syscall_numbers.numbers(os.uname().machine)
text = {key: ctypes.create_string_buffer(value) for key, value in {"queue": b"conformance-allowlist-trial", "user": b"user", "key": b"conformance"}.items()}
assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs, as containment.enter leaves it
fd = syscall_filter.store_descriptor(port)
refusals = syscall_allowlist.install(reporter)
syscall_filter.install(fd)
outcome = {}
def call(what, name, *args):
    found = libc.syscall(ctypes.c_long(numbers[name]), *[ctypes.c_void_p(a) for a in args])
    outcome[what] = "allowed" if found >= 0 else f"refused {ctypes.get_errno()}"
def attempt(what, action):
    try:
        action()
        outcome[what] = "allowed"
    except OSError as error:
        outcome[what] = f"refused {error.errno}"
address = lambda key: ctypes.addressof(text[key])
call("mq_open", "mq_open", address("queue"), os.O_RDWR | os.O_CREAT, 0o600, 0)
call("add_key", "add_key", address("user"), address("key"), address("key"), 3, (1 << 64) - 2)  # the process keyring
call("keyctl", "keyctl", 0, (1 << 64) - 3, 1)  # KEYCTL_GET_KEYRING_ID of the session keyring, created
call("request_key", "request_key", address("user"), address("key"), 0, 0)
attempt("send on the store", lambda: store.send(b"x"))
attempt("write on a socket", lambda: os.write(other.fileno(), b"x"))
attempt("send on another socket", lambda: other.send(b"x"))
attempt("sendmsg", lambda: other.sendmsg([b"x"]))
attempt("fork", lambda: os.fork())
attempt("a thread", lambda: threading.Thread(target=int).start())
helper = {line.split(":")[0]: line.split()[1] for line in open(f"/proc/{reporter.pid}/status") if line.startswith(("Uid", "CapEff"))}
print(json.dumps({"outcome": outcome, "named": None if refusals is None else open(record).read().split(), "helper": helper}))
"""

ON_THE_LIST = {"send on the store", "write on a socket", "a thread"}
OFF_THE_LIST = {"mq_open", "add_key", "keyctl", "request_key"}

needs_seccomp = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"), reason="the filter is made for Linux on x86_64 and aarch64"
)


@needs_seccomp
def test_a_call_off_the_list_is_refused_with_eperm_and_named_and_the_deny_list_still_holds(tmp_path):
    record = tmp_path / "rank0.refused"
    done = subprocess.run([sys.executable, "-c", TRIAL, str(record)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    outcome, named = said["outcome"], said["named"]
    assert {what for what, how in outcome.items() if how == "allowed"} == ON_THE_LIST, outcome
    assert all(how == "refused 1" for what, how in outcome.items() if what not in ON_THE_LIST), outcome  # EPERM
    # named by the helper, in the record the driver reads; the deny list's refusals (sendto off the
    # store, sendmsg, fork) are its own EPERMs, unnamed
    assert named is not None and OFF_THE_LIST <= set(named), named
    if os.geteuid() == 0:  # made while root, as a contained rank makes it: root's record, a helper of its own uid
        assert record.stat().st_uid == 0 and record.stat().st_mode & 0o777 == 0o644
        assert int(said["helper"]["Uid"]) >= 1_000_000 and int(said["helper"]["CapEff"], 16) == 0, said["helper"]


def test_the_measured_list_leaves_out_message_queues_keys_and_new_processes():
    listed = set(syscall_allowlist.ALLOWED) | set(syscall_allowlist.HARNESS)
    assert syscall_allowlist.ALLOWED == tuple(sorted(set(syscall_allowlist.ALLOWED))), "one name per call, sorted"
    assert not listed - set(syscall_numbers.numbers("x86_64")), "a name the kernel does not have"
    assert not listed & {
        "mq_open",
        "mq_timedsend",
        "add_key",
        "request_key",
        "keyctl",
        "fork",
        "vfork",
        "execve",
        "ptrace",
        "setxattr",
        "symlink",
    }


def test_the_program_allows_the_list_and_refuses_another_abi():
    numbers = syscall_allowlist.allowed_numbers("x86_64", ("read", "write"))
    code = syscall_allowlist.program("x86_64", numbers, 0x7FC00000)
    words = [code[i : i + 8] for i in range(0, len(code), 8)]
    assert int.from_bytes(words[1][4:], "little") == 0xC000003E and int.from_bytes(words[4][4:], "little") == syscall_allowlist.X32_SYSCALL_BIT
    assert [int.from_bytes(word[4:], "little") for word in words[6:-1:2]] == [0, 1]  # read, write
    assert int.from_bytes(words[-1][4:], "little") == 0x7FC00000  # the rest: to the helper, which refuses
    # aarch64 has no open or poll: their generic equivalents stand in
    assert syscall_allowlist.allowed_numbers("aarch64", ("open", "poll", "time")) == sorted([56, 73])


def test_the_driver_reads_a_tasks_refusals_once(tmp_path):
    from types import SimpleNamespace

    from parallelism_conformance.harness.driver import refused_calls

    rank = SimpleNamespace(rank=1, log_path=str(tmp_path / "w-rank1.log"))
    assert refused_calls.since_last(rank) == ""  # no record: nothing refused, nothing said
    (tmp_path / "w-rank1.refused").write_bytes(b"mq_open\nadd_key\nmq_open\n")
    said = refused_calls.since_last(rank)
    assert "rank 1's system call filter refused" in said and "add_key (1x), mq_open (2x)" in said, said
    assert refused_calls.since_last(rank) == "" and (tmp_path / "w-rank1.refused").stat().st_size == 0  # emptied
    with open(tmp_path / "w-rank1.refused", "ab") as record:
        record.write(b"keyctl\n")
    assert "keyctl (1x)" in refused_calls.since_last(rank)
