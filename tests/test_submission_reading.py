"""The submission read by the driver (harness/driver/submission/): reaches into the grader, and the
capabilities a submission takes from the suite's bundled implementations, found in its text before
any rank starts. Pure reading, no rank: fast. One run of the suite checks the verdicts reach
results.json (its tests fail at setup, before any rank)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from parallelism_conformance.harness.driver.submission import bundled
from parallelism_conformance.harness.driver.submission.reading import REVIEW_TAG, read, the_projects_own

ROOT = Path(__file__).resolve().parents[1]
WHOLE = "from parallelism_conformance.impls import *  # noqa: F403\n"


def _read(tmp_path: Path, text: str, name: str = "student_impl.py", **options):
    (tmp_path / name).write_text(textwrap.dedent(text))
    return read(str(tmp_path / name), {}, str(tmp_path), **options)


def _taken(reading) -> set[str]:
    return set().union(*(t.capabilities for t in reading.taken)) if reading.taken else set()


def test_a_submission_that_is_the_bundled_implementation_takes_every_capability(tmp_path):
    reading = _read(tmp_path, WHOLE)
    assert {"all_reduce", "broadcast", "data_parallel", "pipeline_parallel", "audit"} <= _taken(reading)
    assert [r.what for r in reading.reaches] == ["imports the suite's module parallelism_conformance.impls"]
    why = reading.rejection("broadcast")
    assert why.startswith("0 points: broadcast is not the submission's own code") and "student_impl.py:1" in why, why
    assert read(str(tmp_path / "student_impl.py"), {}, str(tmp_path), reject_bundled=False).rejection("broadcast") is None


def test_a_copy_of_a_bundled_function_is_found_whatever_it_was_renamed_to(tmp_path):
    source = (ROOT / "impls" / "collectives.py").read_text()
    original = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "all_reduce")

    class Rename(ast.NodeTransformer):  # the function, its arguments and its locals, renamed
        names = {"tensor": "x", "op": "how", "group": "members", "async_op": "later", "kind": "k", "comm": "c", "flat": "f", "chunks": "parts"}

        def visit_Name(self, node):
            return ast.Name(self.names.get(node.id, node.id), node.ctx)

        def visit_arg(self, node):
            return ast.arg(self.names.get(node.arg, node.arg), node.annotation)

    copied = Rename().visit(ast.parse(ast.get_source_segment(source, original)))
    copied.body[0].name = "my_sum"
    copied.body[0].body = copied.body[0].body[1:]  # without its docstring
    reading = _read(tmp_path, f"import torch\n\n{ast.unparse(copied)}\n\n\nall_reduce = my_sum\n")
    [copy] = reading.taken
    assert "my_sum is a copy of impls/collectives.py: all_reduce" in str(copy), copy
    assert "all_reduce" in copy.capabilities and "broadcast" not in copy.capabilities
    assert reading.reaches == []


def test_a_wrapper_of_the_bundled_name_takes_it_and_a_replaced_name_does_not(tmp_path):
    reading = _read(
        tmp_path,
        """
        import parallelism_conformance.impls as bundled
        from parallelism_conformance.impls import *  # noqa: F403


        def _helper(tensor):
            return bundled.all_reduce(tensor)


        def all_reduce(tensor, op=None, group=None, async_op=False):
            return _helper(tensor)


        def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
            return None  # its own (wrong) broadcast: graded as the submission's
        """,
    )
    taken = _taken(reading)
    assert "all_reduce" in taken and "broadcast" not in taken and "scatter" in taken
    assert any("all_reduce wraps the bundled all_reduce" in str(t) for t in reading.taken), reading.taken


def test_a_module_getattr_that_forwards_to_the_bundled_module_takes_what_it_forwards(tmp_path):
    reading = _read(tmp_path, "from parallelism_conformance import impls\n\n\ndef __getattr__(name):\n    return getattr(impls, name)\n")
    assert {"all_reduce", "data_parallel"} <= _taken(reading)


@pytest.mark.parametrize(
    "text, what",
    [
        ("import gc\n", "imports gc"),
        ("import ctypes\n", "imports ctypes"),
        ("import sys\nsys.modules['torch.distributed'] = None\n", "uses sys.modules"),
        ("import importlib\nm = importlib.import_module('x')\n", "uses importlib.import_module"),
        ("import importlib.util\n", "imports importlib.util"),
        ("import builtins\n", "imports builtins"),
        ("x = __builtins__\n", "uses __builtins__"),
        ("exec('x = 1')\n", "calls exec()"),
        ("y = eval('1')\n", "calls eval()"),
        ("c = compile('1', 'f', 'eval')\n", "calls compile()"),
        ("m = __import__('os')\n", "calls __import__()"),
        ("import torch.distributed as dist\ndist.all_reduce = print\n", "writes torch.distributed.all_reduce, on an imported module or object"),
        ("import torch\nsetattr(torch.distributed, 'all_reduce', print)\n", "setattr() on torch.distributed, an imported module or object"),
        ("from torch import nn\nnn.Module.__call__ = print\n", "writes torch.nn.Module.__call__, on an imported module or object"),
        ("import harness\n", "imports the suite's module harness"),
        ("from reference import collectives\n", "imports the suite's module reference"),
    ],
)
def test_each_reach_into_the_grader_is_reported_with_its_line(tmp_path, text, what):
    reading = _read(tmp_path, text)
    assert what in [r.what for r in reading.reaches], reading.reaches
    assert reading.rejection("all_reduce") is None  # flagged, not scored 0, by default
    rejected = read(str(tmp_path / "student_impl.py"), {}, str(tmp_path), reject_reaches=True)
    assert rejected.rejection("all_reduce").startswith("0 points: the submission reaches into the grader")


def test_honest_code_has_nothing_to_report(tmp_path):
    reading = _read(
        tmp_path,
        """
        import importlib.metadata
        from importlib import metadata
        import importlib

        import torch
        import torch.distributed as dist
        from torch.distributed import ReduceOp

        import helpers

        __version__ = importlib.metadata.version("torch")
        torch.backends.cudnn.deterministic = True


        def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
            return helpers.ring(tensor, dist.get_world_size(group))
        """,
    )
    (tmp_path / "reference.py").write_text("X = 1\n")  # its own module of a suite folder's name
    (tmp_path / "helpers.py").write_text("import reference\n\n\ndef ring(tensor, n):\n    return reference.X\n")
    reading = read(str(tmp_path / "student_impl.py"), {}, str(tmp_path))
    assert reading.files == ["student_impl.py", "helpers.py"]
    assert reading.reaches == [] and reading.taken == []


@pytest.mark.parametrize(
    "impl, env",
    [
        ("starter/student_impl.py", {}),
        ("outsiders/collectives/c2_correct.py", {}),
        ("outsiders/collectives/correct_direct_rs_ring_ag.py", {}),
        ("parallelism_conformance.adapters.cs336", {"CS336_SUBMISSION": "tests/fixtures/cs336_submission"}),
    ],
)
def test_the_projects_honest_submissions_are_neither_flagged_nor_scored_zero(impl, env):
    reading = read(impl, env, str(ROOT))
    assert reading.files, "nothing was read"
    assert reading.reaches == [] and reading.taken == [], (reading.reaches, reading.taken)
    if env:  # the CS336 package, which reads its version with importlib.metadata, was read
        assert "cs336_systems/__init__.py" in reading.files and "tests/adapters.py" in reading.files


def test_the_suites_own_modules_and_torch_are_not_read():
    for impl in ("parallelism_conformance.impls", "torch.distributed", "parallelism_conformance.adapters.torch_ddp"):
        assert read(impl, {}, str(ROOT)).files == []


def test_no_correct_outsider_nor_honest_fixture_shares_a_body_with_the_bundled_code():
    """The copy check's false positives, measured on code written without the bundled code."""
    bodies = bundled.index().bodies
    paths = [
        *ROOT.joinpath("outsiders").rglob("*.py"),
        *ROOT.joinpath("starter").rglob("*.py"),
        *ROOT.joinpath("tests/fixtures/cs336_submission").rglob("*.py"),
    ]
    shared = [
        (str(path), name)
        for path in paths
        for name, function in bundled.functions(ast.parse(path.read_text()))
        if bundled.normalised(function) in bodies
    ]
    assert len(paths) > 20 and shared == []


def test_the_verdicts_reach_results_json_before_any_rank_starts(tmp_path):
    (tmp_path / "student_impl.py").write_text("import gc\n" + WHOLE)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance/test_collectives.py", "-q", "-p", "no:cacheprovider", "-k", "test_broadcast",
         "--impl", str(tmp_path / "student_impl.py"), "--hypothesis-profile=grading", "--contain-ranks", "no", "--report-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert results["tests"] and results["score"] == 0, result.stdout[-3000:]
    for test in results["tests"]:
        assert test["status"] == "failed" and "is not the submission's own code" in test["output"], test
        assert REVIEW_TAG in test["tags"] and "imports gc" in test["output"], test
    assert "student_impl.py:1: imports gc" in results["extra_data"]["submission"]["grader_access"]
    assert "the submission, as the driver read it" in result.stdout


def test_only_the_projects_own_implementations_are_exempt_under_the_grading_profile(tmp_path):
    """Mutants and fixtures are the bundled code with one change, graded to try other defences; a
    student's file, wherever it is (a staging folder, a checkout's root), is not exempt."""
    assert the_projects_own("mutants/data_parallel/no_broadcast.py", {}, str(ROOT))
    assert the_projects_own(str(ROOT / "tests" / "fixtures" / "grade_never_earned_impl.py"), {}, "/")
    (tmp_path / "student_impl.py").write_text(WHOLE)
    assert not the_projects_own(str(tmp_path / "student_impl.py"), {}, str(tmp_path))
    assert not the_projects_own("README.md/../student.py", {}, str(ROOT))
