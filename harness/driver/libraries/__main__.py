"""``python -m parallelism_conformance.harness.driver.libraries [library[==version] ...] [pytest options]`` (scripts/libraries):
each library named, at the version named or its pinned one, through the suite in its own venv, with
the usual scorecard per run; without a library, every library of the table at its pinned version
and its older ones, and docs/libraries.md written from the verdicts (a library named: its rows and its
section of docs/libraries.md rewritten, the rest kept). A library==version that cannot
be installed or imported is one line, and the rest go on. ``--document`` writes docs/libraries.md
from the JUnit XML earlier runs left in reports/libraries/, running nothing; ``--explain`` rewrites each
row's explanation from the table as it stands, its verdict kept. ``--prepare [--adapters-only] [library ...]``
makes the venvs the project's tests use (each library's tested version and its reproductions'
versions: ``Library.tested_versions``; with --adapters-only the tested version alone, all the
per-commit tier runs), warm-ups included, and runs nothing: the test command calls it before
tests/test_libraries.py. Exit 0 when the matrix was made (its verdicts are findings, not
the command's failure), or, for --prepare, when every tested version installed and imports; 1
otherwise; 2 on a bad argument."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from parallelism_conformance.harness.driver.libraries.document import expected_time, explain, update, write
from parallelism_conformance.harness.driver.libraries.matrix import asked_capabilities, from_reports, run_library
from parallelism_conformance.harness.driver.libraries.table import LIBRARIES
from parallelism_conformance.harness.driver.libraries.venvs import ROOT, InstallFailed, ensure, venv_of

DOC = ROOT / "docs" / "libraries.md"
REPORT = ROOT / "reports" / "libraries"


def parse(arguments: list[str]) -> tuple[list[tuple[str, str]], list[str], bool]:
    """(library, version) pairs, pytest's options, and whether this is the whole matrix."""
    chosen, options = [], []
    for argument in arguments:
        name, _, version = argument.partition("==")
        if not argument.startswith("-") and name in LIBRARIES and not options:
            chosen.append((name, version or LIBRARIES[name].pinned))
        elif not argument.startswith("-") and not options and "==" in argument:
            raise SystemExit(f"scripts/libraries: unknown library {name!r} (known: {', '.join(LIBRARIES)})")
        else:
            options.append(argument)
    if chosen:
        return chosen, options, False
    return [(name, v) for name, library in LIBRARIES.items() for v in (library.pinned, *library.older)], options, True


def prepare(names: list[str], adapters_only: bool = False) -> int:
    """Each named library's (every library's, where none is named) tested versions made, one line
    each; 1 where a library's tested version did not install or import (a reproduction's version that
    does not import is what its reproduction shows, not a failure here)."""
    unknown = [n for n in names if n not in LIBRARIES]
    if unknown:
        print(f"scripts/libraries --prepare: unknown library {unknown[0]!r} (known: {', '.join(LIBRARIES)})", file=sys.stderr)
        return 2
    status = 0
    for library in [LIBRARIES[n] for n in names] or list(LIBRARIES.values()):
        for version in (library.tested,) if adapters_only else library.tested_versions():
            started = time.monotonic()
            try:
                ensure(venv_of(library, version))
                outcome = "ready"
            except InstallFailed as failed:
                outcome = f"{failed}" + ("" if version != library.tested else " (the version the test command runs its adapters on)")
                status = 1 if version == library.tested else status
            print(f"[libraries] {library.name}=={version}: {outcome} ({time.monotonic() - started:.0f} s)", flush=True)
    return status


def main(arguments: list[str]) -> int:
    if arguments[:1] in (["-h"], ["--help"]):
        # before anything runs: as a pytest option it started the whole matrix and rewrote docs/libraries.md
        print(__doc__.replace("``", "`"))
        return 0
    if arguments[:1] == ["--prepare"]:
        rest = arguments[1:]
        return prepare([a for a in rest if a != "--adapters-only"], adapters_only="--adapters-only" in rest)
    if arguments[:1] == ["--explain"]:
        print(f"[libraries] {explain(DOC)} rows of {Path(DOC).relative_to(ROOT)} explained anew from the table")
        return 0
    if arguments[:1] == ["--document"]:
        verdicts = [
            v
            for name, library in LIBRARIES.items()
            for version in (library.pinned, *library.older)
            for v in from_reports(library, version, REPORT)
        ]
        write(verdicts, DOC, " ".join(arguments[1:]))
        print(f"[libraries] wrote {Path(DOC).relative_to(ROOT)} from {Path(REPORT).relative_to(ROOT)}")
        return 0
    try:
        chosen, options, whole = parse(arguments)
    except SystemExit as bad:
        print(bad, file=sys.stderr)
        return 2
    verdicts, started = [], time.monotonic()
    for name, version in chosen:
        print(f"[libraries] {expected_time(DOC, name, version, ' '.join(options))}", flush=True)
    for name, version in chosen:
        verdicts += run_library(LIBRARIES[name], version, options, REPORT)
    took = time.monotonic() - started
    width = max((len(v.run) for v in verdicts), default=3)
    print("\nlibrary     version  " + "run".ljust(width) + "  capability         verdict")
    for v in verdicts:
        print(f"{v.library:<11} {v.version:<8} {v.run:<{width}}  {v.capability:<18} {v.verdict}: {v.detail[:160]}")
    if whole:
        write(verdicts, DOC, " ".join(options), took_s=took)
    else:
        update(verdicts, DOC, " ".join(options), narrowed=asked_capabilities(options)[0] is not None, took_s=took)
    print(f"[libraries] wrote {Path(DOC).relative_to(ROOT)}" + ("" if whole else f" (the rows of {', '.join(f'{n}=={v}' for n, v in chosen)})"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
