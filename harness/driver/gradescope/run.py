"""What ``run_autograder`` does, once per submission, as root in a fresh container:

1. read the course's choices (``autograder.json``, written by ``scripts/autograder``);
2. check the submission before any rank starts (:mod:`precheck`): a missing or misnamed file, a syntax
   error or an import error is one failed test that says what was expected, with score 0;
3. run the conformance suite under the grading profile, ranks contained, with a time budget taken
   from the platform's limit less what starting and reporting need, so a slow submission gets the
   suite's report ("not run" for what was left) and never the platform's silent zero;
4. make sure ``results.json`` exists and says what happened, whatever the suite did (a usage error, a
   refusal to run uncontained, a crash of the driver, the hard stop before the platform's limit).

It runs from the package setup.sh installed into the image's venv; the unpacked zip
(``<root>/source``) holds only the course's choices and the rubric it names. Usage (run_autograder)::

    python -m parallelism_conformance.harness.driver.gradescope.run [--root /autograder]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from parallelism_conformance.harness.driver.gradescope import limits, precheck, staging
from parallelism_conformance.harness.driver.gradescope.config import FILE_NAME, AutograderConfig, ConfigError, load
from parallelism_conformance.harness.rank import containment

# What the budget leaves of the platform's limit: the container's start and this process before the
# suite (measured: 10-25 s on 1 vCPU), the suite's start and collection (15-40 s), the test running
# when the budget ends (its deadline never passes the budget) and the report. The hard stop comes
# HARD_STOP_MARGIN_S before the limit, so results.json is final before the platform kills the container.
RESERVE_S, RESERVE_FRACTION = 60.0, 0.1
HARD_STOP_MARGIN_S = 20.0
TAIL_LINES = 60


def budget_for(config: AutograderConfig, elapsed_s: float) -> float:
    """The suite's --time-budget: the platform's limit less the reserve and what has already passed."""
    return max(30.0, config.time_limit_s - RESERVE_S - RESERVE_FRACTION * config.time_limit_s - elapsed_s)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(prog="run_autograder", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(os.environ.get("CONFORMANCE_AUTOGRADER_ROOT", "/autograder")),
        help="the platform's folder: submission/, results/ (default /autograder)",
    )
    args = parser.parse_args(argv)
    results = args.root / "results"
    results.mkdir(parents=True, exist_ok=True)
    try:
        config = load(args.root / "source" / FILE_NAME)
        config = dataclasses.replace(config, rubric=str(args.root / "source" / config.rubric))  # absolute stays
    except ConfigError as error:
        return _grader_error(results, None, f"the autograder's {FILE_NAME} is not valid ({error}); rebuild the zip with scripts/autograder")
    advice = limits.tier_advice(limits.read(), "the CS336 set" if config.is_cs336 else "every capability")
    if advice:  # the first line course staff read in the autograder's output
        print(f"[autograder] {advice}", flush=True)
    submission = args.root / "submission"
    if not submission.is_dir():
        return _one_failed_test(
            results, config, precheck.Problem("The submission has the expected file", f"no submission folder at {submission}")
        )
    staged, left_out = staging.stage(submission)
    try:
        found = precheck.locate(staged, config)
        if isinstance(found, precheck.Problem):
            return _one_failed_test(results, config, precheck.Problem(found.name, staging.explained(found.message, left_out)))
        contain = config.contain_ranks == "yes" and containment.possible()
        problem = precheck.syntax_problem(found)
        imported = precheck.check_import(found, contain=contain) if problem is None else None
        problem = problem or imported.problem
        if problem is not None:
            return _one_failed_test(results, config, problem)
        if found.note:
            print(f"[autograder] {found.note}", flush=True)
        return _run_suite(config, found, results, started, imported.import_bytes)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def _one_failed_test(results: Path, config: AutograderConfig, problem: precheck.Problem) -> int:
    print(f"[autograder] {problem.name}: no\n{problem.message}", flush=True)
    _write_one_test(results, config, problem.name, problem.message)
    return 0


def suite_command(config: AutograderConfig, found: precheck.Found, results: Path, budget_s: float, rank_bytes: int | None = None) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "parallelism_conformance",
        "-q",  # the installed suite, from any folder
        "--impl",
        found.impl,
        "--hypothesis-profile=grading",
        "--report-dir",
        str(results),
        "--rubric",
        config.rubric,
        "--time-budget",
        f"{budget_s:.0f}",
        "--contain-ranks",
        config.contain_ranks,
    ]
    command += ["--bundled-code", config.bundled_code] + (["--reject-grader-access"] if config.reject_grader_access else [])
    if config.capability:
        command += ["--capability", config.capability]
    if config.points_possible is not None:
        command += ["--points-possible", f"{config.points_possible:g}"]
    if config.is_cs336:
        command += ["--scope", "cs336"]
    if rank_bytes is not None:  # the first estimate of a rank; the run measures its ranks and lowers the cap
        command += ["--rank-memory", str(max(1, round(rank_bytes / 2**20)))]
    return command


def _run_suite(config: AutograderConfig, found: precheck.Found, results: Path, started: float, import_bytes: int | None) -> int:
    budget = budget_for(config, time.monotonic() - started)
    hard_stop = config.time_limit_s - HARD_STOP_MARGIN_S - (time.monotonic() - started)
    container = limits.read()
    # the first estimate of a rank of this submission (what its import added, measured); the suite
    # then measures its ranks as they train and keeps fewer alive where they cost more
    rank_bytes = limits.first_rank_bytes(import_bytes or 0)
    live_ranks = limits.live_ranks_for(container.memory_bytes, import_bytes or 0)
    command = suite_command(config, found, results, budget, rank_bytes)
    if import_bytes is not None:
        print(
            f"[autograder] importing the submission adds {import_bytes / 2**20:.0f} MiB to a rank: "
            f"{'no cap on' if live_ranks is None else f'at most {live_ranks}'} live ranks to start with, fewer as its ranks measure heavier",
            flush=True,
        )
    print(
        f"[autograder] container: {container}; time budget {budget:.0f} s of the platform's {config.time_limit_s:g} s; {' '.join(command[1:])}",
        flush=True,
    )
    (results / "results.json").unlink(missing_ok=True)  # only the suite's own results, or ours, may be there
    process = subprocess.Popen(
        command,
        cwd=results.parent,
        env={**os.environ, **found.env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    reader = threading.Thread(target=_forward, args=(process.stdout, tail), daemon=True)
    reader.start()
    stopped = False
    try:
        code = process.wait(timeout=max(1.0, hard_stop))
    except subprocess.TimeoutExpired:
        stopped = True
        os.killpg(process.pid, signal.SIGKILL)
        code = process.wait()
    reader.join(timeout=5)
    return _settle(
        config,
        results,
        code,
        stopped,
        list(tail),
        {
            "time_limit_s": config.time_limit_s,
            "budget_s": round(budget),
            "container": str(container),
            "submission": found.note,
            "import_mib": None if import_bytes is None else round(import_bytes / 2**20),
            "max_live_ranks": live_ranks,
        },
    )


def _forward(stream, tail: collections.deque) -> None:
    """The suite's output to the platform's log (bounded per line), its last lines kept for the report."""
    for raw in iter(stream.readline, b""):
        line = raw[:4000].decode(errors="replace").rstrip("\n")
        tail.append(line)
        print(line, flush=True)


def _settle(config: AutograderConfig, results: Path, code: int, stopped: bool, tail: list[str], platform: dict) -> int:
    """results.json says what happened: the suite's own when it wrote one, with the platform's limits
    it ran under, and a note when it was cut."""
    path = results / "results.json"
    try:
        written = json.loads(path.read_text())
    except (OSError, ValueError):
        written = None
    if written is None or not written.get("tests"):
        reason = (
            "the suite was stopped at the platform's time limit before it wrote a report"
            if stopped
            else f"the suite ended (exit code {code}) before it wrote a report"
        )
        return _grader_error(results, config, reason + ":\n" + "\n".join(tail[-25:]))
    if stopped or not written.get("extra_data", {}).get("complete", False):
        note = (
            f"\n\nThe run was stopped {HARD_STOP_MARGIN_S:g} s before the platform's limit of "
            f"{config.time_limit_s:g} s; tests that had not reported are listed as not run."
            if stopped
            else f"\n\nThe suite ended (exit code {code}) before its report was complete; tests that had not reported are listed as not run."
        )
        written["output"] = written.get("output", "") + note
    written.setdefault("extra_data", {})["autograder"] = platform
    _write_json(path, written)
    return 0


def _grader_error(results: Path, config: AutograderConfig | None, message: str) -> int:
    """A report when the suite could not grade: visible, score 0, the cause for course staff."""
    print(f"[autograder] could not grade: {message}", flush=True)
    _write_one_test(
        results, config, "The autograder ran", f"The autograder could not grade this submission; course staff have been shown why.\n\n{message}"
    )
    return 1


def _write_one_test(results: Path, config: AutograderConfig | None, name: str, message: str) -> None:
    """results.json with a single test: what a submission the suite cannot grade gets (score 0 of the
    maximum it would have had, so the course's total stays the same)."""
    maximum = _maximum(config)
    _write_json(
        results / "results.json",
        {
            "score": 0.0,
            "max_score": maximum,
            "output": message,
            "visibility": "visible",
            "stdout_visibility": "visible",
            "tests": [
                {
                    "name": name,
                    "number": "0.1",
                    "score": 0.0,
                    "max_score": maximum,
                    "status": "failed",
                    "output": message,
                    "visibility": "visible",
                }
            ],
            "extra_data": {"complete": True, "precheck": name, "expects": config.expects if config else None},
        },
    )


def _maximum(config: AutograderConfig | None) -> float:
    """The points the claimed capabilities are worth in the rubric (or the total the course set)."""
    if config is None:
        return 0.0
    from parallelism_conformance.harness.driver import capabilities
    from parallelism_conformance.harness.driver.rubric import load_rubric

    try:
        rubric = load_rubric(Path(config.rubric))
    except (OSError, ValueError):
        return 0.0
    possible = config.points_possible or rubric.points_possible
    claimed = capabilities.select(config.capability)
    return float(possible if possible else sum(points for name, points in rubric.items() if name in claimed))


def _write_json(path: Path, data: dict) -> None:
    temporary = path.with_name(path.name + ".partial")
    temporary.write_text(json.dumps(data, indent=2))
    os.replace(temporary, path)


if __name__ == "__main__":
    sys.exit(main())
