"""Attacks on the grade from code under test (issue 13), each in a pytest process of its own as a
grader runs the suite (tests/conftest.py, suite_runner): the grade they aim for never arrives."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from parallelism_conformance.harness.rank import containment, wire

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def run_suite(suite_runner):
    """The suite as a grader runs it, in a pytest process of its own (tests/conftest.py)."""

    def run(impl: str, *args: str, env: dict | None = None, test_file: str = "conformance/test_collectives.py"):
        return suite_runner.run(test_file, "-q", "-p", "no:cacheprovider", "--impl", impl, "--hypothesis-profile=ci", *args, env=env)

    return run


def processes_of_sandbox_users() -> list[str]:
    """Live processes of the uids contained ranks run as (a zombie waiting for init to reap it is dead)."""
    rows = subprocess.run(["ps", "-eo", "uid=,stat=,pid=,args="], capture_output=True, text=True).stdout.splitlines()
    return [row for row in rows if row.split() and int(row.split()[0]) >= containment.UID_LOW and not row.split()[1].startswith("Z")]


@pytest.mark.skipif(not containment.possible(), reason="contained ranks need root")
def test_contained_ranks_cannot_reach_the_report_the_driver_or_the_repository(run_suite):
    base = Path(tempfile.mkdtemp(prefix="conformance-escape-"))  # under /tmp, which every user may traverse
    os.chmod(base, 0o755)  # the rank may reach the folder (to append to its log), never write the report in it
    log, report = base / "escape.log", base / "out"
    log.touch()
    os.chmod(log, 0o666)
    result = run_suite(
        str(FIXTURES / "escaping_impl.py"),
        "-k",
        "test_all_reduce and SUM",
        "--contain-ranks",
        "yes",
        "--report-dir",
        str(report),
        # no shrinking: the attempts are made at the first call, and dozens of contained examples more repeat them
        "--hypothesis-profile=mutation",
        env={"ESCAPE_LOG": str(log), "ESCAPE_REPORT": str(report)},
    )
    assert result.returncode == 1, result.stdout[-3000:]
    attempts = log.read_text()
    assert "detach: PermissionError" in attempts and "detached pid" not in attempts, attempts  # no process started
    assert "read driver memory: PermissionError" in attempts
    assert "write repository: PermissionError" in attempts
    assert "write report: PermissionError" in attempts
    assert "become root: PermissionError" in attempts
    # no process of the sandbox's uid is left, none root again: nothing could rewrite the report
    assert not processes_of_sandbox_users(), "a process a rank started outlived the run"
    results = json.loads((report / "results.json").read_text())
    assert results["score"] == 0 and results["max_score"] == 8 and results["extra_data"]["complete"]
    shutil.rmtree(base)


def test_a_reply_that_is_slow_to_decode_is_refused_at_once():
    shared = []
    for _ in range(40):  # 2**40 leaves in 269 bytes, by memo references
        shared = [shared, shared]
    started = time.monotonic()
    with pytest.raises(wire.ReplyRefused):
        wire.decode_untrusted(pickle.dumps(("done", 0, shared, "")))
    wide = []
    for _ in range(12):  # shallow enough, but 8**12 values
        wide = [wide] * 8
    with pytest.raises(wire.ReplyRefused, match="more than"):
        wire.decode_untrusted(pickle.dumps(wide))
    with pytest.raises(wire.ReplyRefused, match="no data"):
        wire.decode_untrusted(pickle.dumps((b"\x00tensor", "float32", (10**12,), b"")))
    # unrefused, these take hours (2**40 leaves) or terabytes; refused, well under a second alone.
    # 5 s was missed once (5.4 s) beside the mutation runner on 2 cores: the margin, not the check
    assert time.monotonic() - started < 60


def test_a_hanging_submission_gets_its_complete_report_within_the_budget(run_suite, tmp_path):
    """The events, not the clock: the first test of each capability hangs and says so, every later one
    is "not run" because its capability hung (not because the budget was spent), and the report is complete.
    Only the all_reduce tests run, so the hang comes first whatever the load (beside the mutation
    runner on 2 cores, the tests before it once spent a 20 s budget before all_reduce started)."""
    started = time.monotonic()
    result = run_suite(
        str(FIXTURES / "hanging_impl.py"), "-k", "all_reduce", "--rank-timeout", "4", "--time-budget", "60", "--report-dir", str(tmp_path)
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["extra_data"]["complete"]
    outputs = list(t["output"] for t in results["tests"])
    hangs = [
        o
        for o in outputs
        if o.startswith("parallelism_conformance.harness.driver.failures.RanksHung") and "no result within the 4 s deadline" in o
    ]
    assert hangs and all(o in hangs or o.startswith("not run: ") and " already hung in " in o for o in outputs), outputs
    assert sum(o.startswith("not run: all_reduce already hung") for o in outputs) >= 5, outputs
    assert results["score"] < results["max_score"]
    # upper guards only, far past what a run takes (10-25 s): the budget's promise, and no wait for ever
    assert results["execution_time"] <= 60 + 10 and elapsed < 300, (results["execution_time"], elapsed)


def test_a_spent_time_budget_reports_every_test_not_run(run_suite, tmp_path):
    result = run_suite("torch.distributed", "-k", "test_broadcast or test_reduce", "--time-budget", "0.001", "--report-dir", str(tmp_path))
    assert result.returncode == 1, result.stdout[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    outputs = [t["output"] for t in results["tests"]]
    assert results["extra_data"]["complete"] and len(outputs) >= 3, outputs
    assert all(o.startswith("not run: the time budget of 0.001 s") for o in outputs), outputs
    assert results["score"] == 0


def test_an_implementation_cannot_decline_a_pipeline_test_by_saying_cannot(run_suite):
    """NotImplementedError("... cannot ...") is a skip only for the project's own adapters."""
    result = run_suite(
        str(FIXTURES / "declining_impl.py"),
        "-k",
        "test_pipeline_step_matches_the_dense_model",
        test_file="conformance/test_pipeline_parallel.py",
    )
    assert result.returncode == 6, result.stdout[-3000:]  # a failure (as "not implemented"), never a skip
    assert "1 failed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]


def test_an_audit_of_a_claimed_strategy_is_not_skipped_because_the_ranks_say_it_is_missing(run_suite):
    result = run_suite(
        str(FIXTURES / "declining_impl.py"), "-k", "test_data_parallel_step and 2-mlp_frozen_fc1-default", test_file="conformance/audit"
    )
    assert result.returncode == 6 and "has no 'DataParallel'" in result.stdout, result.stdout[-3000:]
    result = run_suite(
        str(FIXTURES / "declining_impl.py"),
        "-k",
        "test_data_parallel_step and 2-mlp_frozen_fc1-default",
        "--capability",
        "collectives,audit",
        test_file="conformance/audit",
    )
    assert result.returncode == 0 and "1 skipped" in result.stdout, result.stdout[-3000:]


def test_a_crash_on_a_case_the_backend_refuses_is_not_a_decline(run_suite):
    result = run_suite(
        str(FIXTURES / "crashing_on_refused_impl.py"), "-k", "test_cases_the_backend_refuses and all_reduce", "--rank-timeout", "5"
    )
    assert result.returncode == 1 and "1 failed" in result.stdout, result.stdout[-3000:]
    assert "SIGABRT" in result.stdout


def test_a_rubric_rewritten_during_the_run_does_not_change_the_grade(run_suite, tmp_path):
    rubric = tmp_path / "rubric.toml"
    rubric.write_text("[capabilities]\nall_reduce = 8\n")
    result = run_suite(
        str(FIXTURES / "rubric_rewriting_impl.py"),
        "-k",
        "test_all_reduce and SUM",
        "--rubric",
        str(rubric),
        "--report-dir",
        str(tmp_path / "out"),
        "--contain-ranks",
        "no",
        "--hypothesis-profile=mutation",  # no shrinking: the rubric is rewritten at the first call
        env={"RUBRIC_TO_REWRITE": str(rubric)},
    )
    assert result.returncode == 1, result.stdout[-3000:]
    assert "1000" in rubric.read_text()  # the rank did rewrite it
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["score"] == 0 and results["max_score"] == 8  # read once, before any rank ran


def test_only_the_projects_own_adapter_modules_may_say_what_torch_cannot():
    """A refusal in the adapters' words is a skip (or a rejected example) only for the modules in
    adapters/, named as modules: a student's file called adapters.py, or any path, is graded."""
    from parallelism_conformance.conformance.verdict import TRUSTED_ADAPTERS

    assert {"parallelism_conformance.adapters.torch_native", "parallelism_conformance.adapters.torch_pipelining"} <= TRUSTED_ADAPTERS
    for impl in (
        "adapters.py",
        "adapters",
        "adapters.torch_native.py",
        "submissions/adapters.torch_native",
        "parallelism_conformance.adapters.student",
        "parallelism_conformance.impls",
        "torch.distributed",
        "parallelism_conformance.adapters.cs336",
    ):  # cs336 runs a student's code
        assert impl not in TRUSTED_ADAPTERS, impl
