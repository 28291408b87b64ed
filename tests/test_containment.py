"""Contained ranks under a container's capabilities (issue 27): whatever capability set the driver
starts with, a contained rank keeps nothing that gives root back, and where it cannot be contained
the grading profile refuses to run it instead of running it with the grader's rights."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from parallelism_conformance.harness.rank import containment
from tests.contained_suite import FIXTURES, SYSTEM_PYTHON, needs_emulation, needs_readable_python, suite_in_container, world_readable


def contained_status(**changes) -> dict[str, str]:
    status = {
        "Uid": "1234\t1234\t1234\t1234",
        "Gid": "1234\t1234\t1234\t1234",
        "Groups": "",
        "CapInh": "0" * 16,
        "CapPrm": "0" * 16,
        "CapEff": "0" * 16,
        "CapBnd": "00000000a80425fb",
        "CapAmb": "0" * 16,
        "NoNewPrivs": "1",
    }
    return {**status, **changes}


def test_leftover_privileges_names_every_way_back_to_root():
    assert containment.leftover_privileges(contained_status(), 1234) == []
    assert containment.leftover_privileges(contained_status(CapPrm="0000000000000004"), 1234, allowed=4) == []
    # what the rank kept when capset failed silently under Docker's capabilities (the measured hole)
    found = containment.leftover_privileges(contained_status(CapPrm="00000000a80425fb"), 1234, allowed=4)
    assert found == ["CapPrm 0xa80425fb beyond the allowed 0x4"]
    assert "Uid" in containment.leftover_privileges(contained_status(Uid="1234\t0\t1234\t1234"), 1234)[0]
    assert "no_new_privs" in containment.leftover_privileges(contained_status(NoNewPrivs="0"), 1234)[0]
    assert "groups" in containment.leftover_privileges(contained_status(Groups="0 27"), 1234)[0]
    assert "CapAmb" in containment.leftover_privileges(contained_status(CapAmb="0000000000000080"), 1234)[0]


@pytest.mark.skipif(not containment.possible(), reason="only root can read counters as another uid")
def test_the_counter_reader_answers_for_its_uid_only_cannot_be_traced_and_fails_closed_when_stopped():
    uid = containment.new_sandbox().uid
    ready_read, ready_write = os.pipe()
    sleeper = os.fork()
    if sleeper == 0:  # a process of the ranks' uid, dumpable as a contained rank makes itself
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        ctypes.CDLL(None).prctl(containment.PR_SET_DUMPABLE, 1, 0, 0, 0)
        os.write(ready_write, b"1")
        signal.pause()
        os._exit(0)
    os.close(ready_write)
    assert os.read(ready_read, 1) == b"1"
    os.close(ready_read)
    reader = containment.CounterReader(uid)
    reader.ANSWER_TIMEOUT_S = 1.0
    try:
        theirs, root_process = reader.read([sleeper, os.getpid()])
        assert theirs is not None and "wchar" in theirs and root_process is None, (theirs, root_process)
        # undumpable: the kernel gives its /proc files to root, so a rank of the same uid cannot trace it
        assert os.stat(f"/proc/{sleeper}/mem").st_uid == uid and os.stat(f"/proc/{reader.pid}/mem").st_uid == 0
        assert reader.read([sleeper])[0] is not None  # asked again: the same child answers
        os.kill(reader.pid, signal.SIGSTOP)  # what a rank of its uid may do to it
        assert reader.read([sleeper]) == [None] and reader.pid is None
        assert reader.read([sleeper]) == [None]
    finally:
        reader.close()
        os.kill(sleeper, signal.SIGKILL)
        os.waitpid(sleeper, 0)


@needs_emulation
@needs_readable_python
def test_under_dockers_capabilities_a_rank_cannot_become_root_or_forge_the_grade():
    base = Path(tempfile.mkdtemp(prefix="conformance-docker-"))
    os.chmod(base, 0o755)  # the rank may reach the folder (to append to its log), never write the report in it
    log, report = base / "escape.log", base / "out"
    log.touch()
    os.chmod(log, 0o666)
    outcome = suite_in_container(
        str(SYSTEM_PYTHON),
        str(FIXTURES / "escaping_impl.py"),
        "--report-dir",
        str(report),
        env={"ESCAPE_LOG": str(log), "ESCAPE_REPORT": str(report)},
    )
    assert outcome.returncode == 1, outcome.stdout[-3000:] + outcome.stderr[-2000:]
    attempts = log.read_text()
    # a contained rank starts no process (harness/rank/syscall_filter.py); the sweep's kill of one that
    # an unfiltered contained process detached is tested on its own (test_the_sweep_...)
    assert "detach: PermissionError" in attempts and "detached pid" not in attempts, attempts
    assert "become root: PermissionError" in attempts and "become root: done" not in attempts, attempts
    assert "write report: PermissionError" in attempts and "read driver memory: PermissionError" in attempts
    # every process the ranks started is gone (the forger among them), so nothing can rewrite the report later
    assert outcome.leftovers == [], outcome.leftovers
    results = json.loads((report / "results.json").read_text())
    assert results["score"] == 0 and results["extra_data"]["complete"], results
    assert "ranks contained" in results["extra_data"]["coverage"]
    shutil.rmtree(base)


@needs_emulation
@pytest.mark.skipif(
    world_readable(Path(os.path.realpath(os.__file__))),
    reason="this Python is world-readable: a contained rank can import it, nothing to refuse",
)
def test_grading_refuses_when_a_contained_rank_could_not_read_its_python(tmp_path):
    outcome = suite_in_container(sys.executable, "parallelism_conformance.impls", "--report-dir", str(tmp_path / "out"))
    assert outcome.returncode == 4, outcome.stdout[-2000:] + outcome.stderr[-2000:]  # a usage error: nothing ran
    said = outcome.stdout + outcome.stderr
    assert "ranks cannot be contained here" in said and os.path.dirname(os.path.realpath(os.__file__)) in said, said
    assert "--contain-ranks no" in said
    told = suite_in_container(sys.executable, "parallelism_conformance.impls", "--contain-ranks", "no", "--report-dir", str(tmp_path / "no"))
    assert told.returncode == 0, told.stdout[-2000:]
    results = json.loads((tmp_path / "no" / "results.json").read_text())
    assert "ranks NOT contained" in results["extra_data"]["coverage"] and results["score"] == results["max_score"]


@needs_emulation
@needs_readable_python
@pytest.mark.parametrize(
    "impl, env, said",
    [
        # its own gloo group, around the relay: only the kernel's count shows it
        (
            str(FIXTURES / "forged_records_impl.py"),
            {"FORGE_HOW": "private_group", "FORGE_LOG": os.devnull},
            "communication that went around the relay",
        ),
        (str(FIXTURES / "undumpable_impl.py"), {}, "could not be read"),
    ],
)
def test_the_kernels_write_count_holds_where_the_driver_lacks_ptrace(impl, env, said):
    """Docker's capabilities have no CAP_SYS_PTRACE: the driver reads its contained ranks' counters
    through a reader of their uid, and a rank that closes them fails the audit instead of hiding."""
    outcome = suite_in_container(
        str(SYSTEM_PYTHON), impl, test_file="conformance/audit", selected="test_point_to_point_only and all_reduce", env=env
    )
    assert outcome.returncode == 1 and said in outcome.stdout, outcome.stdout[-3000:] + outcome.stderr[-2000:]


@pytest.mark.skipif(not containment.possible(), reason="a sweep of another uid needs root")
def test_the_sweep_removes_what_a_uid_left_in_world_writable_places_and_nothing_else(tmp_path):
    """Issue 45, class 5, without a container (the end-to-end test is in tests/test_autograder_attacks.py):
    a file and a folder of the uid, also inside a world-writable folder, go; another owner's stay;
    a folder that is not world-writable is not entered; links are not followed."""
    from parallelism_conformance.harness.rank import sweeping

    uid = containment.new_sandbox().uid
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o1777)
    private = tmp_path / "private"
    private.mkdir()
    left = [tmp_path / "file", shared / "file", shared / "folder"]
    left[0].write_bytes(b"x")
    left[1].write_bytes(b"x")
    left[2].mkdir()
    (left[2] / "inside").write_bytes(b"x")
    kept = [tmp_path / "roots", private / "of-the-uid", shared / "link"]
    kept[0].write_bytes(b"x")
    kept[1].write_bytes(b"x")
    kept[2].symlink_to(private)
    for path in [*left, left[2] / "inside", kept[1]]:
        os.lchown(path, uid, uid)
    os.lchown(kept[2], 0, 0)
    os.chmod(tmp_path, 0o1777)  # a root like /tmp
    removed = sweeping.remove_files_of(uid, roots=(str(tmp_path),))
    assert sorted(removed) == sorted(map(str, left))
    assert not any(path.exists() for path in left) and all(os.path.lexists(path) for path in kept)


@pytest.mark.skipif(not containment.possible(), reason="a sweep of another uid needs root")
def test_the_sweep_removes_a_uids_system_v_segments_and_reaps_a_stopped_child():
    from parallelism_conformance.harness.rank import sweeping

    sandbox = containment.new_sandbox()
    libc = ctypes.CDLL(None, use_errno=True)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # becomes the uid, leaves a segment, says its id, then stops itself
        try:
            os.setgroups([])
            os.setgid(sandbox.uid)
            os.setuid(sandbox.uid)
            segment = libc.shmget(0, ctypes.c_size_t(4096), 0o1000 | 0o600)
            os.write(write_end, str(segment).encode())
            os.kill(os.getpid(), signal.SIGSTOP)
        finally:
            os._exit(0)
    os.close(write_end)
    segment = int(os.read(read_end, 64))
    os.close(read_end)
    assert segment >= 0 and segment in sweeping.ipc_of(sandbox.uid)["shm"]
    assert sweeping.reap(pid, timeout_s=2) is None  # stopped: killed, then reaped, never waited for ever
    containment.sweep(sandbox)
    assert segment not in sweeping.ipc_of(sandbox.uid)["shm"]


def test_a_contained_process_keeps_no_descriptor_it_inherited():
    read_end, write_end = os.pipe()
    keep_read, keep_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            containment.close_inherited({keep_write})
            from multiprocessing import resource_tracker

            open_fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
            os.write(keep_write, json.dumps([open_fds, resource_tracker._resource_tracker._fd]).encode())
        finally:
            os._exit(0)
    os.close(keep_write)
    answer = json.loads(os.read(keep_read, 4096))
    os.waitpid(pid, 0)
    for fd in (read_end, write_end, keep_read):
        os.close(fd)
    open_fds, tracker = answer
    assert read_end not in open_fds and write_end not in open_fds and keep_write in open_fds, answer
    assert tracker is None
