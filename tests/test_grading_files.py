"""The grading files' platform options (harness/driver/reports.py), on Scorecards built by hand:
points in whole cents that add up exactly, Gradescope's visibility and formats from the rubric, a
total the course sets, and the versions and settings a grade was computed with. One end-to-end
run checks the plugin's wiring."""

from __future__ import annotations

import json
import platform
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import hypothesis
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import parallelism_conformance
from parallelism_conformance.harness.driver.reports import apportion, graded, score, versions, write
from parallelism_conformance.harness.driver.rubric import DEFAULT_RUBRIC, Rubric, load_rubric
from parallelism_conformance.harness.driver.scorecard import Scorecard
from parallelism_conformance.harness.driver.scorecard import TestResult as Result  # not Test*: pytest would try to collect it

ROOT = Path(__file__).parent.parent


def exact_sum(values) -> Decimal:
    """The sum of the numbers as results.json writes them (their shortest decimal form), exactly."""
    return sum((Decimal(repr(v)) for v in values), Decimal(0))


def results(capability: str, outcomes: str, file: str = "conformance/test_x.py") -> list[Result]:
    """One test per letter of ``outcomes`` (p: passed, f: failed, s: skipped), defined in that order."""
    names = {"p": "passed", "f": "failed", "s": "skipped"}
    return [
        Result(f"{file}::test_{capability}_{i}", capability, names[o], "" if o == "p" else f"{o} {i}\nexample: n=2", 1.0, line=10 * i)
        for i, o in enumerate(outcomes)
    ]


def card(rows: dict[str, list[Result]]) -> Scorecard:
    card = Scorecard(None, coverage=lambda: "world sizes 1-4 on gloo")
    card.results = {r.nodeid: r for found in rows.values() for r in found}
    return card


def rubric_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rubric.toml"
    path.write_text(text)
    return path


# --- points that add up exactly


def test_seven_points_over_three_tests_add_up_to_exactly_seven():
    tests, totals = score({"broadcast": results("broadcast", "ppp")}, Rubric({"broadcast": 7}))
    assert [t["max_score"] for t in tests] == [2.34, 2.33, 2.33]  # the cent left over goes to the first
    assert exact_sum(t["max_score"] for t in tests) == 7 and totals["broadcast"] == (7.0, 7.0)
    assert all(t["score"] == t["max_score"] for t in tests)


def test_a_full_marks_run_of_the_default_rubric_is_exactly_its_points(tmp_path):
    rubric = load_rubric(DEFAULT_RUBRIC)
    counts = [3, 7, 9, 11, 6, 13]  # tests per capability that split their points unevenly
    rows = {name: results(name, "p" * counts[i % len(counts)]) for i, name in enumerate(rubric)}
    write(card(rows), tmp_path, rubric, DEFAULT_RUBRIC, "parallelism_conformance.impls")
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["score"] == report["max_score"] == sum(rubric.values())
    assert exact_sum(t["max_score"] for t in report["tests"]) == Decimal(repr(sum(rubric.values())))
    for name in rubric:
        assert exact_sum(t["max_score"] for t in report["tests"] if t["tags"] == [name]) == Decimal(repr(rubric[name]))
    assert f"total: {sum(rubric.values()):.2f}/{sum(rubric.values()):.2f}" in (tmp_path / "summary.txt").read_text()


def test_weights_failures_and_skips_still_add_up_exactly():
    rows = {"data_parallel": results("data_parallel", "pfpsf")}
    rubric = Rubric({"data_parallel": 20}, {"test_data_parallel_0": 3, "test_data_parallel_2": 2})
    tests, totals = score(rows, rubric)
    by_name = {t["name"]: t for t in tests}
    # weights 3, 1, 2, (skipped), 1 share 20 points: 8.57 + 2.86 + 5.71 + 2.86 = 20 exactly
    assert [t["max_score"] for t in tests] == [8.57, 2.86, 5.71, 0.0, 2.86]
    assert exact_sum(t["max_score"] for t in tests) == 20
    assert by_name["test_data_parallel_1"]["score"] == 0 and by_name["test_data_parallel_3"]["max_score"] == 0
    assert totals["data_parallel"] == (14.28, 20.0)  # the passed tests' max_scores, summed in cents


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=40))
def test_apportion_is_exact_and_within_a_cent_of_each_quota(total, weights):
    parts = apportion(total, weights)
    if sum(weights) == 0:
        assert parts == [0] * len(weights)
        return
    assert sum(parts) == total and all(part >= 0 for part in parts)
    whole = sum(Fraction(w) for w in weights)
    assert all(abs(part - total * Fraction(w) / whole) < 1 for part, w in zip(parts, weights))


# --- a total the course sets


def test_points_possible_scales_what_ran_to_exactly_n():
    rows = {
        "broadcast": results("broadcast", "ppf"),
        "scatter": results("scatter", "ppppppp"),
        "gather": results("gather", "s"),
    }  # gather ran nothing: it is out of the maximum
    rubric = Rubric({"broadcast": 4, "scatter": 6, "gather": 4, "reduce": 6}, points_possible=100)
    tests, totals = score(rows, rubric)
    assert exact_sum(m for _, m in totals.values()) == 100 and totals["scatter"][1] == 60.0
    assert exact_sum(t["max_score"] for t in tests) == 100
    # the option (--points-possible) overrides the rubric's
    tests, totals = score(rows, rubric, points_possible=33)
    assert exact_sum(t["max_score"] for t in tests) == 33 and totals["broadcast"][1] == 13.2


def test_points_possible_is_written_and_said(tmp_path):
    rows = {"broadcast": results("broadcast", "pp")}
    write(card(rows), tmp_path, Rubric({"broadcast": 4}), Path("r.toml"), "parallelism_conformance.impls", points_possible=30)
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["max_score"] == report["score"] == 30 and report["extra_data"]["points_possible"] == 30
    assert "out of 30 (points_possible)" in (tmp_path / "summary.txt").read_text()


# --- visibility, numbers, formats


def test_a_hidden_capability_and_a_test_of_its_own_visibility():
    rubric = Rubric({"broadcast": 4, "audit": 30}, visibility={"audit": "hidden", "test_broadcast_1": "after_due_date"})
    tests, _ = graded({"broadcast": results("broadcast", "pp"), "audit": results("audit", "pf")}, rubric)
    by_name = {t["name"]: t["visibility"] for t in tests}
    assert by_name == {"test_broadcast_0": "visible", "test_broadcast_1": "after_due_date", "test_audit_0": "hidden", "test_audit_1": "hidden"}


def test_what_students_see_leaves_out_what_is_shown_later(tmp_path):
    rubric = Rubric({"broadcast": 4, "audit": 30}, visibility={"default": "after_published", "audit": "hidden"})
    rows = {"broadcast": results("broadcast", "pf"), "audit": results("audit", "pf")}
    write(card(rows), tmp_path, rubric, Path("r.toml"), "parallelism_conformance.impls")
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["visibility"] == "after_published"
    assert {t["visibility"] for t in report["tests"] if t["tags"] == ["broadcast"]} == {"after_published"}
    assert "audit" not in report["output"] and "test_audit_1" not in report["output"]
    assert "total: shown later" in report["output"] and "test_broadcast_1" in report["output"]
    staff = (tmp_path / "summary.txt").read_text()  # the staff's summary has everything
    assert "test_audit_1" in staff and "total: 17.00/34.00" in staff


def test_numbers_follow_the_rubric_then_the_file():
    rubric = Rubric({"scatter": 6, "broadcast": 4})
    rows = {"broadcast": results("broadcast", "pp"), "scatter": results("scatter", "ppp"), "extra": results("extra", "p")}
    rows["scatter"].reverse()  # finished in another order (xdist): the file's order counts
    tests, _ = graded(rows, rubric)
    assert [(t["number"], t["name"]) for t in tests] == [
        ("1.1", "test_scatter_0"),
        ("1.2", "test_scatter_1"),
        ("1.3", "test_scatter_2"),
        ("2.1", "test_broadcast_0"),
        ("2.2", "test_broadcast_1"),
        ("3.1", "test_extra_0"),
    ]


def test_markdown_output_is_a_table_and_failures_stay_literal(tmp_path):
    rubric = Rubric({"broadcast": 4, "scatter": 6}, output_format="md", test_output_format="md")
    rows = {"broadcast": results("broadcast", "p"), "scatter": results("scatter", "pf")}
    rows["scatter"][1].output = "values differ *here* | `x`\nexample: n=2"
    write(card(rows), tmp_path, rubric, Path("r.toml"), "parallelism_conformance.impls")
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["output_format"] == "md" and report["test_output_format"] == "md"
    assert "| capability | points | passed | failed | skipped |\n|---|---:|---:|---:|---:|" in report["output"]
    assert "| broadcast | 4.00/4.00 | 1 | 0 | 0 |" in report["output"]
    assert "**total: 7.00/10.00**" in report["output"]
    failed = next(t for t in report["tests"] if t["status"] == "failed")
    assert failed["output"] == "```text\nvalues differ *here* | `x`\nexample: n=2\n```"
    assert "total: 7.00/10.00" in (tmp_path / "summary.txt").read_text()  # the file stays plain text


def test_html_output_is_escaped_in_a_pre(tmp_path):
    rubric = Rubric({"broadcast": 4}, output_format="html", test_output_format="html")
    rows = {"broadcast": results("broadcast", "f")}
    rows["broadcast"][0].output = "expected <tensor> & got none"
    write(card(rows), tmp_path, rubric, Path("r.toml"), "parallelism_conformance.impls")
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["output"].startswith("<pre>") and "&lt;tensor&gt; &amp;" in report["output"]
    assert report["tests"][0]["output"] == "<pre>expected &lt;tensor&gt; &amp; got none</pre>"


# --- the rubric's options, read and refused


def test_the_rubric_reads_the_platform_options(tmp_path):
    rubric = load_rubric(
        rubric_file(
            tmp_path,
            'points_possible = 50\nstdout_visibility = "after_due_date"\n'
            'output_format = "md"\ntest_output_format = "simple_format"\n'
            "[capabilities]\nbroadcast = 4\naudit = 30\n"
            '[visibility]\ndefault = "after_published"\naudit = "hidden"\n'
            'test_point_to_point_only = "visible"\n',
        )
    )
    assert (rubric.points_possible, rubric.stdout_visibility, rubric.output_format, rubric.test_output_format) == (
        50.0,
        "after_due_date",
        "md",
        "simple_format",
    )
    assert rubric.visibility_of("audit", "conformance/audit/test_collectives.py::test_point_to_point_only[gloo]") == "visible"
    assert rubric.visibility_of("audit", "conformance/audit/test_collectives.py::test_bytes") == "hidden"
    assert rubric.visibility_of("broadcast") == "after_published" == rubric.default_visibility()


@pytest.mark.parametrize(
    "text, message",
    [
        ('[capabilities]\nbroadcast = 4\n[visibility]\nbroadcast = "secret"\n', "[visibility] broadcast = 'secret'"),
        ('[capabilities]\nbroadcast = 4\n[visibility]\nbrodcast = "hidden"\n', "'brodcast' is neither"),
        ('stdout_visibility = "always"\n[capabilities]\nbroadcast = 4\n', "stdout_visibility = 'always'"),
        ('output_format = "pdf"\n[capabilities]\nbroadcast = 4\n', "output_format = 'pdf'"),
        ("test_output_format = 3\n[capabilities]\nbroadcast = 4\n", "test_output_format = 3"),
        ("points_possible = 0\n[capabilities]\nbroadcast = 4\n", "points_possible = 0"),
        ("points_possible = true\n[capabilities]\nbroadcast = 4\n", "points_possible = True"),
        ('output_fromat = "md"\n[capabilities]\nbroadcast = 4\n', "unknown key 'output_fromat'"),
        ("[capabilities]\nbroadcast = true\n", "[capabilities] table of non-negative points"),
        ("points_possible = inf\n[capabilities]\nbroadcast = 4\n", "points_possible = inf"),
        ('visibility = "hidden"\n[capabilities]\nbroadcast = 4\n', "visibility = 'hidden': expected a [visibility] table"),
    ],
)
def test_a_bad_option_is_refused_naming_the_key_and_the_file(tmp_path, text, message):
    path = rubric_file(tmp_path, text)
    with pytest.raises(ValueError) as error:
        load_rubric(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)


# --- what a grade was computed with


def test_extra_data_holds_the_versions_and_the_hypothesis_settings(tmp_path):
    from parallelism_conformance.harness.driver.reports import hypothesis_settings

    run = {"versions": versions(), "hypothesis": hypothesis_settings("grading", None)}
    write(
        card({"broadcast": results("broadcast", "p")}),
        tmp_path,
        Rubric({"broadcast": 4}),
        Path("r.toml"),
        "parallelism_conformance.impls",
        run=run,
    )
    extra = json.loads((tmp_path / "results.json").read_text())["extra_data"]
    suite = parallelism_conformance.__version__
    assert extra["versions"] == {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "hypothesis": hypothesis.__version__,
        "pytest": pytest.__version__,
        "suite": suite,
    }
    current = settings.default
    assert extra["hypothesis"] == {
        "profile": "grading",
        "max_examples": current.max_examples,
        "derandomize": current.derandomize,
        "seed": None,
        "database": current.database is not None,
    }
    summary = (tmp_path / "summary.txt").read_text()
    assert f"versions: python {platform.python_version()}, hypothesis {hypothesis.__version__}" in summary
    assert "hypothesis: profile grading" in summary


def test_the_profile_in_force_is_the_one_loaded():
    from parallelism_conformance.harness.driver.plugin.profiles import current_profile

    before = current_profile()
    try:
        settings.load_profile("brief")
        assert current_profile() == "brief"
    finally:
        settings.load_profile(before)


def test_the_plugin_writes_the_options_end_to_end(suite_runner, tmp_path):
    rubric = rubric_file(tmp_path, 'output_format = "md"\n[capabilities]\nbroadcast = 7\n[visibility]\ndefault = "after_due_date"\n')
    command = [
        "conformance/test_collectives.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "test_broadcast",
        "--hypothesis-profile=brief",
        "--hypothesis-seed=12345",
        "--report-dir",
        str(tmp_path / "out"),
        "--rubric",
        str(rubric),
        "--points-possible",
        "10",
    ]
    done = suite_runner.run(*command)
    assert done.returncode == 0, done.stdout[-3000:]
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert report["max_score"] == 10 and exact_sum(t["max_score"] for t in report["tests"]) == 10
    assert [(t["number"], t["visibility"]) for t in report["tests"]] == [("1.1", "after_due_date")]
    assert report["visibility"] == "after_due_date" and report["output_format"] == "md"
    assert report["extra_data"]["versions"]["suite"] and report["extra_data"]["versions"]["pytest"] == pytest.__version__
    assert report["extra_data"]["hypothesis"]["profile"] == "brief"
    assert report["extra_data"]["hypothesis"]["seed"] == "12345"
    assert "| broadcast | 10.00/10.00 | 1 | 0 | 0 |" in report["output"]
    bad = suite_runner.run(*command[:-1], "0")
    assert bad.returncode == 4 and "--points-possible must be a positive number" in bad.stderr, bad.stderr[-2000:]


def test_the_autograder_zip_carries_every_folder_the_package_ships():
    """setup.py's FOLDERS become the installed package; the zip's setup.sh installs the suite from
    the zip, so a folder setup.py names and the zip lacks fails every grading install ("package
    directory ... does not exist": parallelize_examples/ did, 2026-12-07)."""
    import ast
    from pathlib import Path

    from parallelism_conformance.harness.driver.gradescope.build import SUITE_FOLDERS

    setup = Path(__file__).resolve().parents[1] / "setup.py"
    assigned = next(
        node.value
        for node in ast.parse(setup.read_text()).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "FOLDERS"
    )
    missing = sorted(set(ast.literal_eval(assigned)) - set(SUITE_FOLDERS))
    assert not missing, f"setup.py ships {missing}, which the autograder's zip does not carry (build.SUITE_FOLDERS)"
