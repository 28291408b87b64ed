"""Grading files from a real run under pytest-xdist: scores follow the rubric, a missing function
scores 0 as "not implemented", every failure explains itself, JUnit XML is written too."""

from __future__ import annotations

import json

import pytest
import torch

from parallelism_conformance.harness.driver.rubric import load_rubric


def test_reports_under_xdist(suite_runner, tmp_path):
    rubric = tmp_path / "rubric.toml"
    rubric.write_text("[capabilities]\nbroadcast = 10\nscatter = 6\ngather = 4\n")
    done = suite_runner.run(
        "conformance/test_collectives.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "2",
        "--impl",
        "tests/fixtures/partial_impl.py",
        "--hypothesis-profile=brief",
        "--report-dir",
        str(tmp_path / "out"),
        "--rubric",
        str(rubric),
        "-k",
        "test_broadcast or test_scatter and not gather or test_gather and not scatter",
    )
    assert done.returncode == 6, done.stdout[-3000:]  # only "not implemented" failures, under xdist too
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    by_name = {t["name"]: t for t in results["tests"]}
    assert by_name["test_broadcast"]["score"] == 10 and by_name["test_broadcast"]["status"] == "passed"
    assert by_name["test_scatter"]["score"] == 0 and by_name["test_scatter"]["max_score"] == 6
    assert by_name["test_scatter"]["output"].startswith("not implemented:")
    assert "has no 'scatter'" in by_name["test_scatter"]["output"]
    assert "reproduce: parallelism-conformance" in by_name["test_gather"]["output"]
    assert results["score"] == 10 and results["max_score"] == 20
    assert all(t["visibility"] == "visible" for t in results["tests"])
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "total: 10.00/20.00" in summary
    # the torch the grade was computed with, in both files (one older than 2.11 adds a warning)
    assert f"\ntorch: {torch.__version__}\n" in summary and results["extra_data"]["torch"] == torch.__version__
    assert "<testsuite" in (tmp_path / "out" / "junit.xml").read_text()


def test_a_bad_rubric_is_refused_before_anything_runs(suite_runner, tmp_path):
    rubric = tmp_path / "rubric.toml"
    rubric.write_text("[capabilities]\nbroadcast = 'ten'\n")
    with pytest.raises(ValueError, match="non-negative points"):
        load_rubric(rubric)
    done = suite_runner.run(
        "conformance/test_collectives.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "--report-dir",
        str(tmp_path / "out"),
        "--rubric",
        str(rubric),
        "-k",
        "broadcast",
    )
    assert done.returncode == 4 and "--rubric" in done.stderr, done.stderr[-2000:]


def test_points_are_shared_by_weight_and_skips_by_the_driver_leave_the_maximum(tmp_path):
    from parallelism_conformance.harness.driver.reports import score
    from parallelism_conformance.harness.driver.scorecard import TestResult

    rubric = tmp_path / "rubric.toml"
    rubric.write_text("[capabilities]\ndata_parallel = 20\n[weights]\ntest_mean = 3\n")
    results = [
        TestResult("f.py::test_mean", "data_parallel", "passed", "", 1.0),
        TestResult("f.py::test_buffers[x]", "data_parallel", "failed", "wrong", 1.0),
        TestResult("f.py::test_tied", "data_parallel", "passed", "", 1.0),
        TestResult("f.py::test_refused", "data_parallel", "skipped", "backend refuses", 1.0),
    ]
    tests, totals = score({"data_parallel": results}, load_rubric(rubric))
    assert totals["data_parallel"] == (16.0, 20.0)  # weights 3 + 1 + 1 share 20 points; the skip is out
    assert {t["name"]: t["max_score"] for t in tests} == {"test_mean": 12.0, "test_buffers[x]": 4.0, "test_tied": 4.0, "test_refused": 0.0}
