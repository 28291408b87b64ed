"""Grading files, written by the pytest process (the xdist controller) when --report-dir is given:
Gradescope's results.json and a plain summary per capability (JUnit XML is pytest's own writer).
They are written when the session starts, again after every test, and at the end, each time by
an atomic rename: a run killed from outside (a grader's time limit) still leaves the last state,
marked incomplete. The rubric is read once, before any rank starts.

Points come from a rubric (TOML) that course staff edit: each capability's points are shared
equally by its tests that ran; a skipped test (a case the backend itself refuses) leaves the
maximum, it is not held against the student. A capability none of whose tests ran is listed as
"not run" and left out of the maximum.
"""
from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

import torch

from harness.driver.scorecard import Scorecard, TestResult

DEFAULT_RUBRIC = Path(__file__).resolve().parents[2] / "grading" / "rubric.toml"


class Rubric(dict):
    """{capability: points}, plus ``weights``: {test function name: relative weight within its
    capability} (default 1), from the optional [weights] table. A capability's points are shared
    among its tests that ran in proportion to their weights: partial credit property by property."""

    def __init__(self, points: dict[str, float], weights: dict[str, float] | None = None):
        super().__init__(points)
        self.weights = dict(weights or {})

    def weight(self, nodeid: str) -> float:
        function = nodeid.split("::", 1)[-1].split("[", 1)[0]
        return self.weights.get(function, 1.0)


def load_rubric(path: Path) -> Rubric:
    with open(path, "rb") as file:
        data = tomllib.load(file)
    points, weights = data.get("capabilities"), data.get("weights", {})
    for table, values in (("capabilities", points), ("weights", weights)):
        if not isinstance(values, dict) or not all(isinstance(v, (int, float)) and v >= 0 for v in values.values()):
            raise ValueError(f"{path}: expected a [{table}] table of non-negative points")
    return Rubric({str(k): float(v) for k, v in points.items()}, {str(k): float(v) for k, v in weights.items()})


def score(rows: dict[str, list[TestResult]], rubric: dict[str, float]) -> tuple[list[dict], dict[str, tuple[float, float]]]:
    """Gradescope test entries, and (score, max) per capability, from the scorecard's rows."""
    weigh = rubric.weight if isinstance(rubric, Rubric) else (lambda nodeid: 1.0)
    tests, totals = [], {}
    for capability, results in rows.items():
        graded = [r for r in results if r.outcome != "skipped"]
        points = rubric.get(capability, 0.0)
        total_weight = sum(weigh(r.nodeid) for r in graded)
        earned = maximum = 0.0
        for result in results:
            share = points * weigh(result.nodeid) / total_weight if result.outcome != "skipped" and total_weight else 0.0
            value = share if result.outcome == "passed" else 0.0
            earned, maximum = earned + value, maximum + share
            tests.append(_entry(result, value, share))
        totals[capability] = (earned, maximum)
    return tests, totals


def _entry(result: TestResult, value: float, maximum: float) -> dict:
    status = {"passed": "passed", "failed": "failed"}.get(result.outcome, "passed")
    output = result.output if result.outcome != "skipped" else f"skipped, not counted: {result.output}"
    return {
        "name": result.nodeid.split("::", 1)[-1],
        "number": result.capability,
        "score": round(value, 4),
        "max_score": round(maximum, 4),
        "status": status,
        "output": output,
        "visibility": "visible",
        "tags": [result.capability],
    }


# The oldest torch the suite has been run on end to end (docs/gpu-runners.md). 2.4.1 was measured
# failing at once: plain collectives (KeyError in the rank program) and every recording world.
OLDEST_TESTED_TORCH = (2, 11)


def older_torch_warning(version: str) -> str | None:
    """What to say when ``version`` (torch.__version__) is older than OLDEST_TESTED_TORCH."""
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if numbers >= OLDEST_TESTED_TORCH:
        return None
    return (f"torch {version} is older than the oldest torch this suite is tested on "
            f"({'.'.join(map(str, OLDEST_TESTED_TORCH))}): a failure may be the suite's, not the implementation's")


def write(scorecard: Scorecard, report_dir: Path, rubric: Rubric, rubric_path: Path, impl: str, *,
          seconds: float | None = None, complete: bool = True) -> Path:
    rows = scorecard.by_capability()
    tests, totals = score(rows, rubric)
    earned = sum(s for s, _ in totals.values())
    maximum = sum(m for _, m in totals.values())
    warning = older_torch_warning(torch.__version__)
    lines = [f"implementation: {impl}", f"rubric: {rubric_path}", f"coverage: {scorecard.coverage()}",
             f"torch: {torch.__version__}", *([f"WARNING: {warning}"] if warning else []), "",
             f"{'capability':<24} {'points':>13}  tests (passed/failed/skipped)"]
    for capability, (got, out_of) in totals.items():
        results = rows[capability]
        count = "/".join(str(sum(r.outcome == k for r in results)) for k in ("passed", "failed", "skipped"))
        unrated = "" if capability in rubric else "  (not in the rubric: 0 points)"
        lines.append(f"{capability:<24} {got:6.2f}/{out_of:6.2f}  {count}{unrated}")
    for capability in sorted(set(rubric) - set(totals)):
        lines.append(f"{capability:<24} {'not run':>13}")
    lines += ["", f"total: {earned:.2f}/{maximum:.2f}"]
    if not complete:
        lines += ["", "INCOMPLETE: the run has not finished (or was stopped from outside); what is above is what "
                      "had finished"]
    failures = [t for t in tests if t["status"] == "failed"]
    if failures:
        lines += ["", "lost points:"]
        lines += [f"- {t['name']}: {_headline(t['output'])}" for t in failures]
    summary = "\n".join(lines) + "\n"
    report_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "score": round(earned, 4),
        "max_score": round(maximum, 4),
        "output": summary,
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": tests,
        **({"execution_time": round(seconds, 1)} if seconds is not None else {}),
        "extra_data": {"coverage": scorecard.coverage(), "implementation": impl, "complete": complete,
                       "torch": torch.__version__},
    }
    _replace(report_dir / "results.json", json.dumps(results, indent=2))
    _replace(report_dir / "summary.txt", summary)
    return report_dir


def _headline(output: str) -> str:
    """A failure's first line, and the example it happened on (dtype, op, world size: the judge's
    "example:" line), on one line."""
    lines = output.splitlines()
    if not lines:
        return "failed"
    example = next((line.strip() for line in lines[1:] if line.strip().startswith("example:")), "")
    return lines[0] + (f" [{example}]" if example else "")


def _replace(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".partial")
    temporary.write_text(text)
    os.replace(temporary, path)
