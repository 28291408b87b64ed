"""The suite on each library's runs, and the matrix of what came out: one pytest per run (the run's
adapter as ``--impl``, its capabilities and the audit as ``--capability``) in the library's own
venv, its JUnit XML read back per capability (each test's ``capability`` property): passed when
every test of it passed (notes of what the library refused included); failed with the first
failing test and its first line; refused when none ran, with the reasons. The verdicts go into
docs/libraries.md with the table's explanations and shims."""

from __future__ import annotations

import os
import re
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from parallelism_conformance.harness.driver.libraries.table import Library, Run
from parallelism_conformance.harness.driver.libraries.venvs import ROOT, InstallFailed, Venv, ensure, venv_of
from parallelism_conformance.harness.driver.scorecard import COSTS_MORE, DIFFERS_BY_DESIGN

# an audit test of a capability the run does not claim skips saying so: not a refusal of the library
UNCLAIMED = "is not claimed (--capability)"


@dataclass
class Verdict:
    library: str
    version: str
    run: str
    capability: str
    verdict: str  # "pass", "costs more", "differs by design", "fail", "refused", "not installed"
    detail: str = ""
    tests: dict = field(default_factory=dict)  # outcome -> count
    why: str = ""


def _first_line(text: str) -> str:
    """The message's first line, with the next one where it ends in a colon ("communication audit:")."""
    # pytest's "E   " marker, not a message's own first letter ("ExceptionGroup" kept whole)
    lines = [re.sub(r"^E(\s+|$)", "", line.strip()).strip() for line in (text or "").splitlines()]
    lines = [line for line in lines if line and not line.startswith(("Traceback", "File ", "^"))]
    if not lines:
        return ""
    return (f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0])[:500]


def _example(text: str) -> str:
    """The failing example as the judge printed it ("example: world_size=1, ..., weight_decay=0.0625"):
    with the last example Hypothesis shrank to, the smallest configuration that still fails."""
    found = [line.split("example:", 1)[1].strip() for line in (text or "").splitlines() if line.lstrip("E ").startswith("example:")]
    return found[-1][:500] if found else ""


def verdicts_of(junit: Path, library: Library, version: str, run: Run) -> list[Verdict]:
    """Per capability of ``run`` (and the audit, per capability it audits), from pytest's JUnit XML."""
    cases: dict[str, list[tuple[str, str, str]]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        verdicts = {p.get("value") for p in case.iter("property") if p.get("name") == "verdict"}
        capability = properties.get("capability", "?")
        module = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        test = f"{Path(module).name}::{case.get('name')}"
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            example = _example(failure.text or "")
            message = _first_line(failure.get("message") or failure.text) + (f" (the example: {example})" if example else "")
            cases.setdefault(capability, []).append(("failed", test, message))
        elif skipped is None and verdicts & {COSTS_MORE, DIFFERS_BY_DESIGN}:
            verdict = DIFFERS_BY_DESIGN if DIFFERS_BY_DESIGN in verdicts else COSTS_MORE
            notes = [p.get("value") for p in case.iter("property") if p.get("name") == "note" and (p.get("value") or "").startswith(verdict)]
            cases.setdefault(capability, []).append((verdict, test, notes[0] if notes else ""))
        elif skipped is not None and UNCLAIMED not in (skipped.get("message") or ""):
            cases.setdefault(capability, []).append(("skipped", test, (skipped.get("message") or "").strip()))
        elif skipped is None:
            cases.setdefault(capability, []).append(("passed", test, ""))
    verdicts = []
    for capability in (*run.capabilities, *(("audit",) if run.audit else ())):
        rows = cases.get(capability, [])
        outcomes = ("passed", "failed", "skipped", COSTS_MORE, DIFFERS_BY_DESIGN)
        counts = {outcome: sum(1 for o, _, _ in rows if o == outcome) for outcome in outcomes}
        counts["passed"] += counts.pop(COSTS_MORE)  # right values: passed, with the cost said apart
        failed = [(test, message) for outcome, test, message in rows if outcome == "failed"]
        costly = [(test, message) for outcome, test, message in rows if outcome == COSTS_MORE]
        designed = [(test, message) for outcome, test, message in rows if outcome == DIFFERS_BY_DESIGN]
        skipped = [(test, message) for outcome, test, message in rows if outcome == "skipped"]
        if failed:
            verdict, detail = "fail", f"{failed[0][0]}: {failed[0][1]}"
        elif designed:  # counted apart from pass and fail, with the library's source in the detail
            verdict, detail = DIFFERS_BY_DESIGN, f"{designed[0][0]}: {designed[0][1][:600]}"
        elif costly:
            verdict, detail = (
                COSTS_MORE,
                f"{counts['passed']} passed, {len(costly)} above the theory's bytes: {costly[0][0]}: {costly[0][1][:400]}",
            )
        elif counts["passed"]:
            verdict = "pass"
            detail = f"{counts['passed']} passed" + (
                f"; {counts['skipped']} refused or skipped: {skipped[0][0]}: {skipped[0][1][:300]}" if skipped else ""
            )
        elif rows:
            verdict, detail = "refused", f"{skipped[0][0]}: {skipped[0][1][:400]}"
        else:
            verdict, detail = "refused", "no test ran"
        why = explanation(library, run, capability, failed[0][0] if failed else (skipped[0][0] if skipped else ""))
        verdicts.append(Verdict(library.name, version, run.label, capability, verdict, detail, counts, why))
    return verdicts


def explanation(library: Library, run: Run, capability: str, test: str) -> str:
    """The table's explanation of a verdict: keyed "<run label>: <test id>" (one run's), a test id
    ("test_file.py::test_name", a prefix of the failing one) or a capability."""
    for key, text in library.explained.items():
        scope, _, name = key.rpartition(": ")
        if scope and scope != run.label:
            continue
        if name == capability or (test and test.startswith(name)):
            return text
    return ""


def junit_of(report: Path, venv: Venv, run: Run) -> Path:
    return report / f"{venv.path.name}-{re.sub(r'[^A-Za-z0-9]+', '-', run.label).strip('-')}.xml"


def from_reports(library: Library, version: str, report: Path) -> list[Verdict]:
    """The verdicts of the runs' JUnit XML that an earlier run left in ``report`` (none where a
    run's is missing): docs/libraries.md rewritten without running the suite again."""
    venv = venv_of(library, version)
    return [
        v
        for run in library.runs
        if junit_of(report, venv, run).exists()
        for v in verdicts_of(junit_of(report, venv, run), library, version, run)
    ]


def run_suite(venv: Venv, run: Run, pytest_options: list[str], report: Path, log=print) -> list[Verdict]:
    """pytest on the run's adapter in the library's venv; the verdicts per capability."""
    capabilities = ",".join((*run.capabilities, *(("audit",) if run.audit else ())))
    junit = junit_of(report, venv, run)
    command = [
        str(venv.python),
        "-m",
        "pytest",
        "conformance",
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
        "--impl",
        run.adapter,
        "--capability",
        capabilities,
        f"--junitxml={junit}",
        *pytest_options,
    ]
    env = venv.environment({**os.environ, "PYTHONUNBUFFERED": "1"})
    log(f"[libraries] {venv.library.name}=={venv.version} {run.label}: --impl {run.adapter} --capability {capabilities}")
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, text=True, capture_output=True)
    log(
        done.stdout[done.stdout.find("conformance scorecard") - 20 :]
        if "conformance scorecard" in done.stdout
        else done.stdout[-3000:] + done.stderr[-2000:]
    )
    log(f"[libraries] {time.monotonic() - started:.0f} s")
    if not junit.exists():
        return [
            Verdict(
                venv.library.name,
                venv.version,
                run.label,
                c,
                "fail",
                f"pytest wrote no report (exit {done.returncode}): {_first_line(done.stderr[-2000:])}",
            )
            for c in run.capabilities
        ]
    return verdicts_of(junit, venv.library, venv.version, run)


def asked_capabilities(pytest_options: list[str]) -> tuple[set[str] | None, list[str]]:
    """``--capability X[,Y]`` taken out of the pytest options (None: not given) and the rest."""
    asked, rest, options = None, [], iter(pytest_options)
    for option in options:
        if option == "--capability":
            asked = set(next(options, "").split(","))
        elif option.startswith("--capability="):
            asked = set(option.split("=", 1)[1].split(","))
        else:
            rest.append(option)
    return asked, rest


def narrowed(run: Run, asked: set[str] | None) -> Run | None:
    """The run with only the capabilities asked for (its audit where "audit" is asked), None where it
    maps none of them; the run itself where nothing was asked."""
    if asked is None:
        return run
    capabilities = tuple(c for c in run.capabilities if c in asked)
    audit = run.audit and "audit" in asked
    return Run(run.label, run.adapter, capabilities, audit) if capabilities or audit else None


def run_library(library: Library, version: str, pytest_options: list[str], report: Path, log=print) -> list[Verdict]:
    """Every run of one library==version (``--capability`` among the options narrows each run to
    what it maps of them, and skips a run that maps none); one "not installed" line when it cannot
    be installed or imported."""
    try:
        venv = ensure(venv_of(library, version), log)
    except InstallFailed as failed:
        log(f"[libraries] {library.name}=={version}: {failed}")
        # the table's word on it: keyed "<name> <version>", or "<name>" for every version
        why = library.explained.get(f"{library.name} {version}", library.explained.get(library.name, ""))
        return [Verdict(library.name, version, "-", "-", "not installed", str(failed), why=why)]
    report.mkdir(parents=True, exist_ok=True)
    asked, options = asked_capabilities(pytest_options)
    runs = [r for r in (narrowed(run, asked) for run in library.runs) if r is not None]
    if not runs:
        log(f"[libraries] {library.name}: no run maps {', '.join(sorted(asked))}")
    return [
        v for i, run in enumerate(runs, 1) for v in run_suite(venv, run, options, report, lambda text, i=i: log(_numbered(text, i, len(runs))))
    ]


def _numbered(text: str, i: int, of: int) -> str:
    """A run's log lines say which of the library's runs it is (progress, for a matrix that takes minutes)."""
    return text.replace("[libraries] ", f"[libraries] run {i}/{of}: ", 1) if text.startswith("[libraries] ") else text
