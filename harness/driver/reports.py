"""Grading files, written by the pytest process (the xdist controller) when --report-dir is given:
Gradescope's results.json and a plain summary per capability (JUnit XML is pytest's own writer).
They are written when the session starts, again after every test, and at the end, each time by
an atomic rename: a run killed from outside (a grader's time limit) still leaves the last state,
marked incomplete. The rubric is read once, before any rank starts.

Points come from a rubric (TOML) that course staff edit: each capability's points are shared by
its tests that ran in proportion to their weights; a skipped test (a case the backend itself
refuses) leaves the maximum, it is not held against the student. A capability none of whose tests
ran is listed as "not run" and left out of the maximum. Points are counted in whole cents, so the
values written add up exactly (apportion).
"""

from __future__ import annotations

import ast
import html
import json
import os
import platform
import re
from fractions import Fraction
from pathlib import Path

import hypothesis
import pytest
import torch

import parallelism_conformance
from parallelism_conformance.harness.driver.failures import NOT_GRADED
from parallelism_conformance.harness.driver.report_summary import as_text, rendered, summarize
from parallelism_conformance.harness.driver.rubric import Rubric
from parallelism_conformance.harness.driver.scorecard import Scorecard, TestResult
from parallelism_conformance.harness.driver.submission.reading import flag_entries

# the package's __init__.py (parallelism_conformance/), in a checkout and installed alike: it holds __version__
VERSION_FILE = Path(parallelism_conformance.__file__)


def apportion(total: int, weights: list[float]) -> list[int]:
    """Hamilton's largest-remainder method: whole parts of ``total`` in proportion to ``weights``
    that sum to exactly ``total``. Each part is the floor of its quota total * w / sum(w), and the
    units left go to the largest remainders (ties to the earlier), so no part is a unit or more
    from its quota. Exact (rational arithmetic): the same weights always give the same parts."""
    whole = sum(Fraction(w) for w in weights)
    if not weights or whole <= 0:
        return [0] * len(weights)
    quotas = [total * Fraction(w) / whole for w in weights]
    parts = [q.numerator // q.denominator for q in quotas]
    left = total - sum(parts)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - parts[i]), i))
    for i in by_remainder[:left]:
        parts[i] += 1
    return parts


def cents(points: float) -> int:
    return round(points * 100)


def capability_order(rubric: Rubric, capabilities) -> dict[str, int]:
    """The first part of a test's ``number``: a capability's place in the rubric (1-based), then
    those the rubric does not list, by name."""
    listed = list(rubric)
    others = sorted(set(capabilities) - set(listed))
    return {name: i + 1 for i, name in enumerate(listed + others)}


def in_file_order(results: list[TestResult]) -> list[TestResult]:
    """A capability's tests as their files define them (file, line, then node id for parameters),
    whatever order they finished in (xdist)."""
    return sorted(results, key=lambda r: (r.nodeid.split("::", 1)[0], r.line, r.nodeid))


def capability_maxima(rows: dict[str, list[TestResult]], rubric: Rubric, points_possible: float | None = None) -> dict[str, int]:
    """Each capability's maximum in cents. Unscaled: its rubric points when some test of positive
    weight ran, else 0. With ``points_possible`` N: N cents apportioned among those maxima, so
    that whatever ran adds up to exactly N (nothing scaled when nothing with points ran)."""
    exact = {}
    for capability, results in rows.items():
        ran = sum(rubric.weight(r.nodeid) for r in results if r.outcome != "skipped")
        exact[capability] = cents(rubric.get(capability, 0.0)) if ran > 0 else 0
    if points_possible is None or sum(exact.values()) == 0:
        return exact
    return dict(zip(exact, apportion(cents(points_possible), list(exact.values()))))


def graded(
    rows: dict[str, list[TestResult]], rubric: Rubric, points_possible: float | None = None
) -> tuple[list[dict], dict[str, tuple[int, int]]]:
    """Gradescope test entries in ``number`` order, and (score, max) in cents per capability.
    A capability's maximum is apportioned among its tests that ran by weight; a passed test
    scores its max_score, a failed one 0, a skipped one 0 of 0."""
    pairs, totals = _graded(rows, rubric, points_possible)
    return [entry for _, entry in pairs], totals


def _graded(
    rows: dict[str, list[TestResult]], rubric: Rubric, points_possible: float | None
) -> tuple[list[tuple[TestResult, dict]], dict[str, tuple[int, int]]]:
    """``graded``, each entry with the result it was made from."""
    rubric = rubric if isinstance(rubric, Rubric) else Rubric(rubric)
    possible = rubric.points_possible if points_possible is None else points_possible
    maxima = capability_maxima(rows, rubric, possible)
    order = capability_order(rubric, rows)
    pairs, totals = [], {}
    for capability in sorted(rows, key=order.__getitem__):
        results = in_file_order(rows[capability])
        ran = [r for r in results if r.outcome != "skipped"]
        shares = dict(zip((r.nodeid for r in ran), apportion(maxima[capability], [rubric.weight(r.nodeid) for r in ran])))
        earned = 0
        for index, result in enumerate(results, start=1):
            share = shares.get(result.nodeid, 0)
            value = share if result.outcome == "passed" else 0
            earned += value
            pairs.append(
                (
                    result,
                    _entry(
                        result,
                        value,
                        share,
                        f"{order[capability]}.{index}",
                        rubric.visibility_of(capability, result.nodeid),
                        rubric.test_output_format,
                    ),
                )
            )
        totals[capability] = (earned, maxima[capability])
    return pairs, totals


def score(
    rows: dict[str, list[TestResult]], rubric: Rubric, points_possible: float | None = None
) -> tuple[list[dict], dict[str, tuple[float, float]]]:
    """Gradescope test entries, and (score, max) in points per capability (``graded``)."""
    tests, totals = graded(rows, rubric, points_possible)
    return tests, {capability: (got / 100, out_of / 100) for capability, (got, out_of) in totals.items()}


def _entry(result: TestResult, value: int, maximum: int, number: str, visibility: str, output_format: str) -> dict:
    status = {"passed": "passed", "failed": "failed"}.get(result.outcome, "passed")
    output = result.output if result.outcome != "skipped" else f"skipped, not counted: {result.output}"
    return {
        "name": result.nodeid.split("::", 1)[-1],
        "number": number,
        "score": value / 100,
        "max_score": maximum / 100,
        "status": status,
        "output": formatted_output(output, output_format),
        "visibility": visibility,
        "tags": [result.capability, *(["costs more"] if result.costs_more else []), *(["differs by design"] if result.by_design else [])],
    }


def formatted_output(text: str, output_format: str) -> str:
    """A test's plain text (a failure's message, tracebacks included) as it is shown literally in
    ``output_format``: in a fenced block for Markdown, a <pre> for HTML, as it is otherwise."""
    if not text:
        return text
    if output_format == "md":
        longest = max((len(run) for run in re.findall(r"`{3,}", text)), default=0)
        fence = "`" * max(3, longest + 1)  # CommonMark: a fence longer than any run inside it
        return f"{fence}text\n{text}\n{fence}"
    if output_format == "html":
        return f"<pre>{html.escape(text)}</pre>"
    return text


# The oldest torch the suite has been run on end to end (docs/gpu-runners.md). 2.4.1 was measured
# failing at once: plain collectives (KeyError in the rank program) and every recording world.
OLDEST_TESTED_TORCH = (2, 11)


def older_torch_warning(version: str) -> str | None:
    """What to say when ``version`` (torch.__version__) is older than OLDEST_TESTED_TORCH."""
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if numbers >= OLDEST_TESTED_TORCH:
        return None
    return (
        f"torch {version} is older than the oldest torch this suite is tested on "
        f"({'.'.join(map(str, OLDEST_TESTED_TORCH))}): a failure may be the suite's, not the implementation's"
    )


def suite_version(source: Path = VERSION_FILE) -> str:
    """The suite's version, its package's ``__version__`` read as data (ast): asking importlib.metadata,
    which searches sys.path, could find the submission's code instead."""
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]:
            return str(ast.literal_eval(node.value))
    raise ValueError(f"{source} assigns no __version__")


def versions(source: Path = VERSION_FILE) -> dict[str, str]:
    """What a grade depends on besides the submission: Python, torch, Hypothesis, pytest, the suite."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "hypothesis": hypothesis.__version__,
        "pytest": pytest.__version__,
        "suite": suite_version(source),
    }


def hypothesis_settings(profile: str, seed) -> dict:
    """The Hypothesis settings in effect (``hypothesis.settings.default``, after the profile was
    loaded) that decide which examples are drawn: a derandomized profile draws the same examples
    every run; otherwise ``seed`` (--hypothesis-seed) does, and None means each run draws anew.
    An example database replays earlier failures first."""
    current = hypothesis.settings.default
    return {
        "profile": profile,
        "max_examples": current.max_examples,
        "derandomize": current.derandomize,
        "seed": seed,
        "database": current.database is not None,
    }


def _header(scorecard: Scorecard, rubric_path: Path, impl: str, run: dict, possible: float | None) -> list[tuple[str, str]]:
    # the rubric by its file name: a grading machine's folders are nobody's business in a student's report
    header = [("implementation", impl), ("rubric", rubric_path.name), ("coverage", scorecard.coverage()), ("torch", torch.__version__)]
    if run.get("versions"):
        header.append(("versions", ", ".join(f"{k} {v}" for k, v in run["versions"].items() if k != "torch")))
    if run.get("hypothesis"):
        header.append(("hypothesis", _drawn(run["hypothesis"])))
    if possible is not None:
        header.append(("points", f"scaled so that what ran is out of {possible:g} (points_possible)"))
    if run.get("submission", {}).get("grader_access"):  # the driver's reading: harness/driver/submission
        header.append(("review", f"the submission reaches into the grader: {'; '.join(run['submission']['grader_access'][:8])}"))
    warning = older_torch_warning(torch.__version__)
    return header + ([("WARNING", warning)] if warning else [])


def _drawn(settings: dict) -> str:
    """How the examples were drawn, in words (hypothesis_settings)."""
    seed = (
        "derandomized" if settings["derandomize"] else (f"seed {settings['seed']}" if settings["seed"] is not None else "a new seed each run")
    )
    database = "" if settings["database"] else ", no example database"
    return f"profile {settings['profile']}, {settings['max_examples']} examples, {seed}{database}"


def write(
    scorecard: Scorecard,
    report_dir: Path,
    rubric: Rubric,
    rubric_path: Path,
    impl: str,
    *,
    seconds: float | None = None,
    complete: bool = True,
    points_possible: float | None = None,
    run: dict | None = None,
) -> Path:
    """results.json and summary.txt. ``points_possible`` (--points-possible) overrides the
    rubric's; ``run`` holds ``versions`` and ``hypothesis`` (settings), read before any rank started."""
    rubric = rubric if isinstance(rubric, Rubric) else Rubric(rubric)
    run = dict(run or {})
    possible = rubric.points_possible if points_possible is None else points_possible
    rows = scorecard.by_capability(with_pending=True)
    pairs, totals = _graded(rows, rubric, possible)
    header = _header(scorecard, rubric_path, impl, run, possible)
    claimed = run.get("claimed")
    staff = as_text(summarize(rows, pairs, totals, rubric, header, complete=complete, for_students=False, claimed=claimed))
    students = rendered(
        summarize(rows, pairs, totals, rubric, header, complete=complete, for_students=True, claimed=claimed), rubric.output_format
    )
    report_dir.mkdir(parents=True, exist_ok=True)
    flag_entries([entry for _, entry in pairs], run.get("submission"), rubric.test_output_format)  # reaches into the grader
    results = {
        "score": sum(s for s, _ in totals.values()) / 100,
        "max_score": sum(m for _, m in totals.values()) / 100,
        "output": students,
        "output_format": rubric.output_format,
        "test_output_format": rubric.test_output_format,
        "visibility": rubric.default_visibility(),
        "stdout_visibility": rubric.stdout_visibility,
        "tests": [entry for _, entry in pairs],
        **({"execution_time": round(seconds, 1)} if seconds is not None else {}),
        "extra_data": {
            "coverage": scorecard.coverage(),
            "implementation": impl,
            "complete": complete,
            "torch": torch.__version__,
            "points_possible": possible,
            "not_graded": [entry["name"] for r, entry in pairs if r.outcome == "skipped" and r.output.startswith(NOT_GRADED)],
            "costs_more": [entry["name"] for r, entry in pairs if r.costs_more],
            "differs_by_design": [entry["name"] for r, entry in pairs if r.by_design],
            **run,
        },
    }
    _replace(report_dir / "results.json", json.dumps(results, indent=2))
    _replace(report_dir / "summary.txt", staff)
    return report_dir


def _replace(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".partial")
    temporary.write_text(text)
    os.replace(temporary, path)
