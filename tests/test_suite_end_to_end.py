"""The conformance suite as a user runs it, in a pytest process of its own (tests/conftest.py,
suite_runner): a broken implementation fails its own tests with a clear message and the run goes on
to report everything else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def run_suite(suite_runner):
    def run(impl: str, *args: str):
        return suite_runner.run(
            "conformance/test_collectives.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "--impl",
            impl,
            "--hypothesis-profile=ci",
            "--rank-timeout",
            "5",
            *args,
        )

    return run


def scorecard_row(output: str, capability: str) -> list[str]:
    rows = [line.split() for line in output.splitlines() if line.startswith(capability + " ")]
    assert rows, f"no scorecard row for {capability} in:\n{output[-3000:]}"
    return rows[-1]


def test_a_crashing_collective_fails_alone_and_the_run_continues(run_suite):
    result = run_suite(str(FIXTURES / "crashing_impl.py"), "-k", "test_all_reduce and SUM or test_broadcast or test_gather")
    assert result.returncode == 1, result.stdout[-3000:]
    assert "1 failed, 2 passed" in result.stdout
    assert "SIGSEGV" in result.stdout and "example: world_size=" in result.stdout
    assert scorecard_row(result.stdout, "all_reduce")[-1] == "FAIL"
    assert scorecard_row(result.stdout, "broadcast")[-1] == "pass"


def test_missing_functions_fail_their_own_tests_and_never_collection(run_suite):
    result = run_suite(str(FIXTURES / "partial_impl.py"), "-k", "test_broadcast or test_scatter and not gather or test_all_reduce and MAX")
    assert result.returncode == 6, result.stdout[-3000:]  # only "not implemented" failures: not pytest's 1
    assert "2 failed, 1 passed" in result.stdout
    assert "has no 'scatter'" in result.stdout and "has no 'all_reduce'" in result.stdout
    assert scorecard_row(result.stdout, "broadcast")[-1] == "pass"
    assert "exit status 6: every failure is something the implementation does not provide" in result.stdout


def test_claiming_only_what_is_provided_ends_green(run_suite):
    result = run_suite(
        str(FIXTURES / "partial_impl.py"), "--capability", "broadcast,all_reduce", "-k", "test_broadcast or test_all_reduce and MAX"
    )
    assert result.returncode == 6, result.stdout[-3000:]  # all_reduce is claimed and missing
    result = run_suite(str(FIXTURES / "partial_impl.py"), "--capability", "broadcast", "-k", "test_broadcast or test_all_reduce")
    assert result.returncode == 0, result.stdout[-3000:]
    assert scorecard_row(result.stdout, "broadcast")[-1] == "pass"


def test_a_hanging_collective_is_cut_at_the_deadline_without_shrinking(run_suite):
    result = run_suite(str(FIXTURES / "hanging_impl.py"), "-k", "test_all_reduce and SUM or test_broadcast", "--rank-timeout", "2")
    assert result.returncode == 1, result.stdout[-3000:]
    assert "1 failed, 1 passed" in result.stdout
    assert "no result within the 2 s deadline" in result.stdout
    assert "hanging_impl.py" in result.stdout  # the hung rank's stack points at the culprit


def test_the_starter_template_scores_not_implemented_and_breaks_nothing(run_suite):
    result = run_suite("starter/student_impl.py", "-k", "test_broadcast or test_all_reduce and SUM")
    assert result.returncode == 6, result.stdout[-3000:]
    assert "2 failed" in result.stdout
    assert "NotImplementedError: broadcast" in result.stdout
    assert scorecard_row(result.stdout, "broadcast")[-2:] == ["not", "implemented"]


def test_an_implementation_that_patches_the_oracle_and_harness_in_its_ranks_still_fails(run_suite):
    marker = Path(__import__("tempfile").gettempdir()) / "conformance-grade-forged"
    marker.unlink(missing_ok=True)
    # the mutation profile: no shrinking, whose dozens of forged examples more say nothing new (29 s under ci)
    result = run_suite(
        str(FIXTURES / "grade_forging_impl.py"), "-k", "test_all_reduce and SUM or test_broadcast", "--hypothesis-profile=mutation"
    )
    assert result.returncode == 1, result.stdout[-3000:]
    assert "2 failed" in result.stdout  # its forged answers are refused for every collective
    assert "refuses to decode" in result.stdout
    assert not marker.exists()


@pytest.mark.parametrize(
    "option, message",
    [
        (["--rank-timeout", "0"], "--rank-timeout must be a positive number of seconds, got 0"),
        (["--hypothesis-profile=nope"], "--hypothesis-profile=nope: no such profile; this suite registers quick, ci"),
        (["--max-world-size", "0"], "--max-world-size must be at least 1"),
        (["--attach", "2", "--attach-address", "nohost"], "--attach-address must be HOST:PORT, got 'nohost'"),
        pytest.param(
            ["--backend", "nccl"],
            "--backend nccl needs at least one visible GPU; none is visible",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible"),
        ),
    ],
)
def test_a_bad_option_is_one_usage_error_that_names_it_before_any_test_runs(run_suite, option, message):
    result = run_suite("parallelism_conformance.impls", *option)
    assert result.returncode == 4, result.stdout[-3000:]  # pytest's usage-error code
    assert f"ERROR: {message}" in result.stderr
    assert "passed" not in result.stdout and "INTERNALERROR" not in result.stderr


def test_a_run_that_cannot_draw_two_ranks_reports_not_tested_never_pass(run_suite, tmp_path):
    """What a 1-GPU runner with --backend nccl gets (here: --max-world-size 1 on gloo): nothing
    needing two ranks ran, so nothing is counted as passed, and every output says why."""
    result = run_suite(
        "parallelism_conformance.impls",
        "-k",
        "test_all_reduce and SUM or test_broadcast",
        "--max-world-size",
        "1",
        "--report-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 skipped, " in result.stdout and " passed," not in result.stdout
    assert scorecard_row(result.stdout, "all_reduce")[-2:] == ["not", "tested"]
    coverage = "world 1 on gloo (CPU ranks); no world of 2 or more ranks: nothing distributed is tested"
    assert f"coverage: {coverage}" in result.stdout
    assert f"coverage: {coverage}" in (tmp_path / "summary.txt").read_text()
    assert f'name="coverage" value="{coverage}"' in (tmp_path / "junit.xml").read_text()


def test_every_test_of_a_run_without_two_ranks_is_skipped_with_why_never_failed(suite_runner):
    """Measured on a 1-GPU H200 with --backend nccl: tests that draw a layout of two or more ranks
    (the audit's) asked the pool for a world the plan does not have and failed with a ValueError.
    Every conformance test, at --max-world-size 1, must be skipped in the driver with the reason."""
    # brief: what is checked (every test skipped, never passed) holds for any number of examples
    result = suite_runner.run(
        "conformance", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--hypothesis-profile=brief", "--max-world-size", "1", "-rs"
    )
    assert result.returncode == 0, result.stdout[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.split()[1].rstrip(",") == "skipped" and "passed" not in summary and "failed" not in summary, summary
    assert "needs a world of at least 2 ranks; this run draws at most 1" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.endswith(" not tested")]
    assert len(rows) >= 20, result.stdout[-3000:]


def test_an_example_torch_cannot_run_is_rejected_and_the_test_goes_on(suite_runner, tmp_path):
    """The project's adapter of torch's pipelining refuses most random orders (its runtime looks a
    loss up by microbatch position): those examples are rejected and others drawn until 50 were
    refused, so torch's runtime still runs some; a test none of whose examples it can run (unequal
    microbatches) is skipped with the reasons after ten. Before, the first refusal skipped the whole
    test."""
    junit = tmp_path / "junit.xml"
    result = suite_runner.run(
        "conformance/test_pipeline_parallel.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "--impl",
        "parallelism_conformance.adapters.torch_native",
        "--hypothesis-profile=ci",
        "-rs",
        "-k",
        "test_any_valid_schedule or test_unequal",
        f"--junitxml={junit}",
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "1 passed, 1 skipped" in result.stdout, result.stdout[-3000:]
    assert "no drawn example ran: 10x torch.distributed.pipelining cannot run microbatches of unequal sizes" in result.stdout, result.stdout[
        -3000:
    ]
    notes = re.findall(
        r'name="note" value="(\d+) examples ran; (\d+) drawn examples the library under test cannot run '
        r"were not(, and drawing stopped there)?, as: \d+x torch.distributed.pipelining cannot run a "
        r"schedule",
        junit.read_text(),
    )
    assert len(notes) == 1, junit.read_text()[-3000:]
    ran, refused, stopped = int(notes[0][0]), int(notes[0][1]), notes[0][2]
    assert 0 < ran <= 25 and 0 < refused <= 50 and bool(stopped) == (refused == 50), notes
