"""Issue 45's ways through the grading run, tried in the emulated grading container (Docker's
default capabilities, 1.5 GiB, no network) as a student's submission would. Each test names the
class of attack it belongs to and the defence of the class it checks (docs/grading.md, the threat
model):

1. a check that decides a verdict or a skip runs where the implementation cannot reach;
2. the audit's kernel evidence: every byte a contained rank sends is counted by the kernel where the
   rank cannot reach (a system call filter leaves it only counted channels; the store's socket is
   counted from the kernel's TCP statistics; what it printed is credited only as the driver read it);
3. root never acts for the student: no link in the submission is followed, ranks inherit no
   descriptor of a root process;
4. a grade always arrives: waits on contained children are bounded, replies bounded by the memory;
5. nothing a world's uid left outlives the world;
6. the submission is read by the driver (issue 58, item 3): what it takes from the suite's bundled
   implementations scores 0, and its reaches into the grader are flagged for review;
7. a filter that allows (issue 58, item 2): a contained rank makes only the system calls measured
   into its allow list; any other fails with EPERM, named in the test's failure;
8. evidence from outside the rank (issue 58, item 1): the audit decides on what the driver's relay
   carried between the ranks, and on the kernel's count of what each wrote, never on the rank's
   own records;
9. speed buys no examples (issue 58, item 4): every drawn test covers its strata first, and a test
   too slow to cover them in its share of the time budget fails on time, naming those left.

Classes 1, 3 (descriptors), 4 (replies) and 5 share one grading run of one hostile submission
(tests/fixtures/grade_never_earned_impl.py), each checked by a test of its own.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from parallelism_conformance.harness.driver.gradescope import config, precheck, trial
from parallelism_conformance.harness.rank import containment
from tests.autograder_trial import grade
from tests.contained_suite import FIXTURES as _FIXTURES
from tests.contained_suite import SYSTEM_PYTHON, needs_emulation, needs_readable_python, suite_in_container

FIXTURES = Path(__file__).parent / "fixtures"
CORRECT = "from parallelism_conformance.impls import *  # noqa: F403\n"
# checkpoint_tp's test runs first (its file sorts before the collectives'), on the world of 2 that the
# backend probe would reuse; all_reduce is what the probe forges, and its large message the reply
HOSTILE_CLAIM = "checkpoint_tp,all_reduce"


@pytest.fixture(scope="module")
def hostile(installed):
    """One grading run of the hostile submission; what its ranks tried, and the /dev/shm file of
    root's that it asked the resource tracker to unlink."""
    base = Path(tempfile.mkdtemp(prefix="conformance-hostile-"))
    os.chmod(base, 0o755)
    log = base / "attempts.log"
    log.touch()
    os.chmod(log, 0o666)
    name = f"conformance-witness-{secrets.token_hex(4)}"
    witness = Path("/dev/shm") / name
    witness.write_text("root's, and no contained rank may delete it\n")
    os.chmod(witness, 0o644)
    outcome, results, _ = grade(
        installed,
        {"student_impl.py": FIXTURES / "grade_never_earned_impl.py"},
        env={"HOSTILE_LOG": str(log), "HOSTILE_SHM_NAME": name},
        settings={"capability": HOSTILE_CLAIM, "bundled_code": "report"},  # its correct parts are the bundled code's
    )
    attempts = log.read_text().splitlines()
    yield outcome, results, attempts, witness
    for line in attempts:  # whatever a failed sweep left, so that one failure does not fill the disk
        if line.startswith("left file "):
            Path(line.removeprefix("left file ")).unlink(missing_ok=True)
    witness.unlink(missing_ok=True)
    shutil.rmtree(base, ignore_errors=True)


def _attempts_log(prefix: str) -> tuple[Path, Path]:
    """(a folder of root's, a log in it that a contained rank may append to): what a fixture tried."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(base, 0o755)
    log = base / "attempts.log"
    log.touch()
    os.chmod(log, 0o666)
    return base, log


def _tests(results: dict, prefix: str) -> list[dict]:
    return [test for test in results["tests"] if test["name"].startswith(prefix)]


def test_class_1_the_backend_probe_runs_in_a_world_that_never_imported_the_implementation(hostile):
    """Class 1: the submission replaced the probe's rank program in every rank it ran in (those of the
    checkpoint test among them, the world of 2 the probe would have reused); the probe never ran
    there, and every all_reduce test ran and failed instead of skipping as "the gloo backend
    refuses all_reduce"."""
    _, results, attempts, _ = hostile
    assert not any(line.startswith("forged the backend probe") for line in attempts), attempts
    value_tests = _tests(results, "test_all_reduce[")
    assert len(value_tests) == 8, [t["name"] for t in results["tests"]]
    assert all(test["status"] == "failed" and "exited with code 7" in test["output"] for test in value_tests), [
        (test["name"], test["output"][:200]) for test in value_tests
    ]
    assert sum(test["score"] for test in results["tests"] if "all_reduce" in test["name"]) == 0, results["output"]


# How each way of hiding an all_reduce's traffic ends: "counted" (the audit sees the bytes and fails
# the test), or "refused" (the call that would hide them fails in the rank, which then fails the test).
# Since the allow list (class 7), ftruncate, fallocate and pwrite on the FIFO (which failed as OSError
# before) are refused with EPERM, the pipe that vmsplice and splice need is never made, and the
# datagram's socket is refused at bind, before its sendto: each named in the test's output.
HIDING = {
    "inflated_output": ["ftruncate stdout: PermissionError", "fallocate stdout: PermissionError", "pwrite past the end: PermissionError"],
    "store": [" B: done"],  # "store set of N B: done": the send went out
    "datagram": [],
}
NAMED = {"inflated_output": ["ftruncate (", "fallocate (", "pwrite64 (", "pipe2 ("], "datagram": ["bind ("], "store": []}


@needs_emulation
@needs_readable_python
@pytest.mark.parametrize("how", sorted(HIDING))
def test_class_2_traffic_around_the_recorder_is_counted_or_refused(how):
    """Class 2: an all_reduce whose records show nothing, its traffic hidden from the kernel's count
    (tests/fixtures/hidden_traffic_impl.py): its output inflated to be credited (the measured attack:
    ftruncate), its tensor sent through the store's socket with send (measured), or in UDP datagrams
    (a new way of the class). Each is counted or refused, and the audit's test fails."""
    base, log = _attempts_log("conformance-hidden-")
    outcome = suite_in_container(
        str(SYSTEM_PYTHON),
        str(_FIXTURES / "hidden_traffic_impl.py"),
        test_file="conformance/audit",
        selected="test_point_to_point_only and all_reduce",
        env={"HIDE_HOW": how, "HIDE_LOG": str(log)},
    )
    attempts = log.read_text()
    shutil.rmtree(base)
    assert outcome.returncode == 1, outcome.stdout[-3000:]
    assert "1 failed" in outcome.stdout and "ranks contained" in outcome.stdout, outcome.stdout[-3000:]
    for expected in HIDING[how]:
        assert expected in attempts, attempts
    assert how == "store" or ": done" not in attempts, attempts
    if how == "store":
        assert "communication that went around the relay" in outcome.stdout, outcome.stdout[-3000:]
    else:
        assert "calls outside its allow list" in outcome.stdout, outcome.stdout[-3000:]
    for call in NAMED[how]:
        assert call in outcome.stdout, outcome.stdout[-3000:]


def test_class_3_ranks_inherit_no_descriptor_of_a_root_process(hostile):
    """Class 3: a rank that writes a registration to the resource tracker's pipe (root's) would have
    the tracker unlink a root file in /dev/shm when the run ends; the ranks hold no such pipe."""
    outcome, _, attempts, witness = hostile
    assert not any(line.startswith("registered") for line in attempts), attempts
    assert witness.exists(), "the resource tracker (root) unlinked a file a contained rank registered"


def test_class_4_a_reply_is_bounded_by_the_containers_memory(hostile):
    """Class 4: replies of an all_reduce that stream just under 1 GiB each from a 1 MiB buffer are
    refused at their length header; the driver is not OOM-killed and the report is complete."""
    outcome, results, attempts, _ = hostile
    assert any(line.startswith("streaming a reply") for line in attempts), attempts
    assert outcome.oom_kills == 0 and results["extra_data"]["complete"], (outcome.oom_kills, results["output"][-2000:])
    [large] = _tests(results, "test_large_message[all_reduce]")
    assert large["status"] == "failed" and "over the driver's limit" in large["output"], large["output"][:2000]


def test_class_5_nothing_a_world_left_outlives_it(hostile):
    """Class 5: files made with posix_fallocate in /tmp and /dev/shm and a System V segment, left by
    ranks and by the precheck's import, are gone when the run ends."""
    _, _, attempts, _ = hostile
    files = [line.removeprefix("left file ") for line in attempts if line.startswith("left file ")]
    segments = [int(line.removeprefix("left shm ")) for line in attempts if line.startswith("left shm ")]
    assert files and segments, attempts
    assert not [path for path in files if os.path.exists(path)], "files outlived their world"
    with open("/proc/sysvipc/shm") as listing:
        alive = {int(line.split()[1]) for line in list(listing)[1:]}
    assert not alive & set(segments), "System V segments outlived their world"


def test_class_3_root_never_follows_a_link_in_the_submission(installed):
    """Class 3: a student_impl.py that links to a file only root may read is left out of the staged
    submission, said by name, and nothing of the file reaches the results."""
    secret = Path(tempfile.mkdtemp(prefix="conformance-secret-")) / "root-only.txt"
    secret.write_text("root-only secret 7f3a9c\n")  # not Python: a syntax error would show this line
    os.chmod(secret, 0o600)
    outcome, results, _ = grade(installed, {"student_impl.py": trial.Symlink(secret)})
    shown = json.dumps(results) + outcome.stdout
    assert "7f3a9c" not in shown, results["tests"][0]["output"]
    [test] = results["tests"]
    assert test["status"] == "failed" and "student_impl.py (a symbolic link" in test["output"], test["output"]
    shutil.rmtree(secret.parent)


@pytest.mark.skipif(not containment.possible(), reason="the contained import needs root")
def test_class_4_an_import_that_stops_itself_gets_an_answer_in_bounded_time():
    """Class 4: the precheck's child closes its answer pipe and stops itself; the wait is bounded and
    the submission is told its import gave no answer (no container: the precheck alone)."""
    started = time.monotonic()
    found = precheck.Found(str(FIXTURES / "stopping_import_impl.py"), {})
    problem = precheck.import_problem(found, contain=True, timeout_s=60)
    assert problem is not None and "gave no answer" in problem.message, problem
    assert time.monotonic() - started < 45  # the reap's patience is 10 s; the import itself a few


def test_class_6_the_suites_own_answer_imported_scores_zero_and_is_flagged(installed):
    """Class 6 (issue 58): a submission whose whole text imports the suite's bundled implementation
    (installed in the image, so every rank could import it) got full marks; the driver now reads it
    before any rank starts, and each claimed capability scores 0 saying why, every test flagged."""
    outcome, results, _ = grade(installed, {"student_impl.py": CORRECT}, settings={"capability": "broadcast"})
    assert results["extra_data"]["complete"] and results["score"] == 0 and results["max_score"] == 4.0, outcome.stdout[-3000:]
    for test in results["tests"]:
        assert test["status"] == "failed" and "is not the submission's own code" in test["output"], test
        assert "review: grader access" in test["tags"] and "parallelism_conformance.impls" in test["output"], test
    assert results["extra_data"]["submission"]["bundled_code"], results["extra_data"]


@needs_emulation
@needs_readable_python
def test_class_7_a_call_off_the_allow_list_is_refused_and_named():
    """Class 7 (issue 58, item 2): an all_reduce that opens a POSIX message queue (a kernel object
    that outlived the sweep) got its marks; the call is refused now, and the failure names it though
    the implementation's own error does not, and though it first killed every child of its rank
    (the helper that names refused calls is one, of another uid: tests/fixtures/unlisted_call_impl.py)."""
    outcome = suite_in_container(str(SYSTEM_PYTHON), str(_FIXTURES / "unlisted_call_impl.py"))
    said = outcome.stdout
    assert outcome.returncode == 1 and "ranks contained" in said, said[-3000:] + outcome.stderr[-2000:]
    assert "[Errno 1] Operation not permitted" in said and "calls outside its allow list" in said and "mq_open (" in said, said[-3000:]
    assert "read by the driver from the rank's record" in said, said[-3000:]


@needs_emulation
@needs_readable_python
@pytest.mark.parametrize("impl", ["parallelism_conformance.impls", "torch.distributed"])
def test_class_7_the_bundled_implementations_and_torch_pass_under_the_allow_list(impl):
    """Class 7: what the list was measured on still passes contained: the collectives' file, in part."""
    # the strata (every dtype, groups, roots, uneven sizes) run first whatever the profile: one drawn example past them
    outcome = suite_in_container(
        str(SYSTEM_PYTHON),
        impl,
        "--hypothesis-profile=smoke",
        "--contain-ranks",
        "yes",
        selected="all_reduce or broadcast or all_to_all or reduce_scatter",
    )
    assert outcome.returncode == 0 and "ranks contained" in outcome.stdout, outcome.stdout[-3000:] + outcome.stderr[-2000:]


def test_the_correct_submission_is_not_left_out_by_staging(tmp_path):
    """Staging keeps what a correct submission holds: regular files in folders, with their bytes."""
    from parallelism_conformance.harness.driver.gradescope import staging

    (tmp_path / "hw" / "sub").mkdir(parents=True)
    (tmp_path / "hw" / "student_impl.py").write_text(CORRECT)
    (tmp_path / "hw" / "sub" / "notes.txt").write_bytes(b"\x00\x01")
    (tmp_path / "link.py").symlink_to(tmp_path / "hw" / "student_impl.py")
    os.mkfifo(tmp_path / "fifo")
    staged, left_out = staging.stage(tmp_path)
    try:
        assert (staged / "hw" / "student_impl.py").read_text() == CORRECT
        assert (staged / "hw" / "sub" / "notes.txt").read_bytes() == b"\x00\x01"
        assert sorted(left_out) == ["fifo (not a regular file)", "link.py (a symbolic link: only regular files are graded)"], left_out
        assert precheck.locate(staged, config.AutograderConfig(expects="student_impl.py")).note
    finally:
        shutil.rmtree(staged)


@needs_emulation
@needs_readable_python
def test_class_8_what_a_rank_records_is_evidence_of_nothing():
    """Class 8 (issue 58, item 1): an all_reduce that runs a backend all-gather and rewrites its
    records into a ring's sends and receives, with free receives that explain more bytes
    (tests/fixtures/forged_records_impl.py), got 30/30 from the audit. The records are now only
    attribution: the relay saw the all-gather on the group it was given. The forgery ran (its log
    says so). The same forgery over a gloo group of the implementation's own, around the relay, is
    tests/test_containment.py's: the kernel's count of what the rank wrote exceeds what the relay
    carried."""
    how = "backend"
    base, log = _attempts_log("conformance-forged-")
    outcome = suite_in_container(
        str(SYSTEM_PYTHON),
        str(_FIXTURES / "forged_records_impl.py"),
        test_file="conformance/audit",
        selected="test_point_to_point_only and all_reduce",
        env={"FORGE_HOW": how, "FORGE_LOG": str(log)},
    )
    attempts = log.read_text()
    shutil.rmtree(base)
    said = outcome.stdout
    assert "forged records: done" in attempts, attempts
    assert outcome.returncode == 1 and "1 failed" in said and "ranks contained" in said, said[-3000:]
    assert "backend collective call(s) (allgather_into_tensor x1)" in said, said[-3000:]


@needs_emulation
@needs_readable_python
def test_class_9_speed_buys_no_examples(tmp_path):
    """Class 9 (issue 58, item 4): under a time budget a test stopped drawing at its share (never
    before 10 examples) and the derandomized order is public, so a wrong implementation slow enough
    to spend its share before its bug's example kept its points. Every drawn test now covers its
    strata first, whatever the speed: a broadcast right in every value that sleeps 2.5 s a call
    (tests/fixtures/slow_broadcast_impl.py), graded with a 16 s budget, fails test_broadcast on time,
    naming the strata it did not cover (8 strata at 2.5 s outlast the whole budget), scored 0."""
    report = tmp_path / "out"
    outcome = suite_in_container(
        str(SYSTEM_PYTHON),
        str(_FIXTURES / "slow_broadcast_impl.py"),
        *("--time-budget", "16", "--report-dir", str(report)),
        selected="test_broadcast",
    )
    assert outcome.returncode == 1 and "ranks contained" in outcome.stdout, outcome.stdout[-3000:] + outcome.stderr[-2000:]
    tests = {test["name"]: test for test in json.loads((report / "results.json").read_text())["tests"]}
    broadcast = tests["test_broadcast"]
    assert broadcast["status"] == "failed" and broadcast["score"] == 0, broadcast
    assert "too slow to cover its strata: covered " in broadcast["output"] and " of 8 strata in its " in broadcast["output"], broadcast
    assert "not covered: " in broadcast["output"] and "dtype=uint8" in broadcast["output"], broadcast  # the last stratum, never reached
