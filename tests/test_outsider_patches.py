"""harness/driver/outsider_patches.py: every bug under outsiders/<capability>/bugs/ applies to its
author's correct file and gives a buggy implementation; a diff that does not fit is refused."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from parallelism_conformance.harness.driver.outsider_patches import materialise, patched, unified

DIFFS = sorted((Path(__file__).parent.parent / "outsiders").glob("*/bugs/*.diff"))


@pytest.mark.parametrize("diff", DIFFS, ids=lambda d: f"{d.parent.parent.name}/{d.stem}")
def test_every_bug_applies_to_its_correct_file_and_says_it_fails(diff, tmp_path):
    path = materialise(diff, tmp_path)
    assert path.name == diff.stem + ".py" and path.stat().st_mode & 0o777 == 0o644
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "verdict: fail" in doc.splitlines()


def test_a_diff_whose_context_does_not_match_is_refused_naming_it(tmp_path):
    (tmp_path / "bugs").mkdir()
    (tmp_path / "good.py").write_text("a = 1\nb = 2\nc = 3\n")
    (tmp_path / "bad.py").write_text("a = 1\nb = 0\nc = 3\n")
    diff = tmp_path / "bugs" / "bad.diff"
    diff.write_text(unified(tmp_path / "good.py", tmp_path / "bad.py"))
    assert patched(diff) == ("bad.py", "a = 1\nb = 0\nc = 3\n")
    (tmp_path / "good.py").write_text("a = 9\nb = 2\nc = 3\n")  # the base moved on under the diff
    with pytest.raises(ValueError, match=r"bad\.diff: hunk @@ -1,3 \+1,3 @@ does not apply to good\.py: line 1"):
        patched(diff)


@pytest.mark.parametrize(
    "base, buggy",
    [
        ("x = 1\ny = 2", "x = 1\ny = 3"),
        ("x = 1\ny = 2", "x = 1\ny = 2\n"),
        ("x = 1\ny = 2\n", "x = 0\ny = 2"),
        ("x = 1\r\ny = 2\n", "x = 1\r\ny = 5\n"),
    ],
)
def test_a_last_line_without_a_newline_and_other_line_ends_survive_byte_for_byte(base, buggy, tmp_path):
    (tmp_path / "bugs").mkdir()
    (tmp_path / "good.py").write_bytes(base.encode())
    (tmp_path / "bad.py").write_bytes(buggy.encode())
    diff = tmp_path / "bugs" / "bad.diff"
    diff.write_bytes(unified(tmp_path / "good.py", tmp_path / "bad.py").encode())
    assert materialise(diff, tmp_path / "bugs").read_bytes() == buggy.encode()
