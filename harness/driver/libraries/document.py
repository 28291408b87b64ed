"""docs/libraries.md from the matrix's verdicts: per library, version, run and capability the
verdict (pass; costs more with its ratio; differs by design with the library's source; fail with
the first failing test and why; refused with the library's reason; not installed with pip's or the
import's line), then every shim the adapters apply and what each failure is, from
harness/driver/libraries/table.py."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

from parallelism_conformance.harness.driver.libraries.matrix import Verdict
from parallelism_conformance.harness.driver.libraries.table import LIBRARIES

HEAD = """# The libraries teams train with, through the suite

Written by `scripts/libraries` (the whole matrix: every library of `harness/driver/libraries/table.py`
at its pinned version and its older ones, each in its own venv `.venv-libraries/<name>-<version>`:
the library over the project's venv, which holds requirements.lock, torch==2.13.0 CPU included, with
the lock as pip's constraints). `scripts/libraries deepspeed==0.18.3` runs one and rewrites its rows and section here.
Each row: one run of the suite on the library's adapter (`--impl`) for one capability, on 1-4 gloo CPU ranks; the audit row covers the
communication audit of the run's capabilities. Every fail and refusal says why (the last column,
from the table's `explained`, or the library's own words in the detail); a library's bug is shown by
a standalone reproduction in `tests/libraries/` that does not use the suite.

Three verdicts, never mixed (issue 56). **fail**: a value or a semantic differs from the reference
(a gradient, a parameter, which parameters hold a gradient). **costs more**: right values, and bytes
above the theory's bound, shown with the ratio and the calls that make it (a failure only under
`--require-bounds yes`, which grading and a team's own implementation get by default). **differs by
design**: a difference that the reference, run with a behaviour the library's table entry declares
with its source (`by_design`), reproduces exactly; the contract's failure otherwise stands. A row's
verdict is its worst: fail, then differs by design, then costs more, then pass.

In the test command: `scripts/libraries --prepare --adapters-only` makes the venv of each library's
tested version (the pinned one; nanotron 0.2, since 0.4 does not import) while `tests/` runs, and
`tests/test_libraries.py` runs every adapter on one drawn example of each capability it maps, one
pytest run per adapter (10 runs), failing on a crash or a failure the table does not explain. The
standalone reproductions run nightly (`scripts/test --full`, which prepares their versions too): they
use no code of this project. A library venv holds only the library and what the lock lacks (it sees
the project's venv through a .pth file): measured from a fresh clone, the seven venvs took 10-50 s
each (deepspeed 0.19.8 74 s with its op build, torchtitan 0.3.0 50 s), where a venv of its own,
torch reinstalled, took 144-218 s.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _shortened(detail: str, limit: int = 500) -> str:
    """A row's detail within ``limit`` characters, keeping the example's end, where the keys that make
    it fail sit (a message cut from the end lost them: "weight_decay=0.0625")."""
    if len(detail) <= limit:
        return detail
    message, marker, example = detail.partition(" (the example: ")
    if not marker:
        return detail[:limit]
    room = max(limit - len(marker) - 200, 100)
    return f"{message[:200]}...{marker}...{example[-room:]}"


def _row(v: Verdict) -> str:
    return f"| {v.library} | {v.version} | {_cell(v.run)} | {v.capability} | **{v.verdict}** | {_cell(_shortened(v.detail))} | {_cell(v.why)} |"


def _section(library) -> list[str]:
    """A library's part below the table: what it needs, the lock lines it is not held to, its shims
    and every explanation, all from its table entry."""
    lines = ["", f"## {library.name}", ""]
    if library.system_packages:
        lines.append(
            "Needs (Debian packages, installed by `scripts/libraries` where the command is missing): "
            + ", ".join(f"`{p}` (`{c}`)" for c, p in library.system_packages.items())
            + "."
        )
    if library.unconstrained:
        lines.append(
            "Its venv is neither installed from nor constrained by these lines of requirements.lock: "
            + "; ".join(f"`{name}` ({why})" for name, why in library.unconstrained.items())
            + "."
        )
    if library.environment:
        lines.append("Ranks run with " + ", ".join(f"`{k}={v}`" for k, v in library.environment.items()) + ".")
    lines += ["", "Shims (each stands in for one library line, never for its arithmetic or communication):", ""]
    lines += [f"- {what} (stands in for: {line})" for what, line in library.shims] or ["- none"]
    lines += [
        "",
        "Configurations its users set (drawn per example by the tests marked `library_configuration`, the default first; a failure shrinks toward the defaults):",
        "",
    ]
    lines += [
        f"- `{s.key}`: {', '.join(f'`{v!r}`' for v in s.values)}, for {', '.join(s.capabilities)}{f' (since {s.since})' if s.since else ''}: {s.why}"
        for s in library.settings
    ] or [f"- none: {library.settings_note}"]
    if library.settings and library.settings_note:
        lines.append(f"- beside them: {library.settings_note}")
    if library.averages_micro_batches:
        lines += [
            "",
            f"Gradient accumulation through its own counter averages the micro-batches, and the reference does the same for it: {library.averages_micro_batches}.",
        ]
    if library.by_design:
        lines += ["", "Differs by design (documented behaviours the reference runs too, with their sources):", ""]
        lines += [f"- `{name}`: {what} ({source})" for name, (what, source) in library.by_design.items()]
    if library.explained:
        lines += ["", "Every failure and refusal explained:", ""]
        lines += [f"- `{key}`: {text}" for key, text in library.explained.items()]
    return lines


def _options(options: str) -> str:
    return f"with pytest options `{options}`" if options else "Hypothesis profile `quick`"


def _took(seconds: float | None) -> str:
    return "" if seconds is None else f", {seconds:.0f} s for the runs"


def write(verdicts: list[Verdict], path: Path, options: str, libraries: dict = LIBRARIES, took_s: float | None = None) -> None:
    lines = [
        HEAD,
        f"Last run: {datetime.date.today().isoformat()}, {_options(options)}{_took(took_s)}.\n",
        "| library | version | run | capability | verdict | detail | why |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_row(v) for v in verdicts]
    for name in dict.fromkeys(v.library for v in verdicts if v.library in libraries):
        lines += _section(libraries[name])
    path.write_text("\n".join(lines) + "\n")


def _key(row: str) -> tuple[str, str]:
    cells = row.split(" | ")
    return cells[0].removeprefix("| "), cells[1]


def _cell_key(row: str) -> tuple[str, str, str, str]:
    """library, version, run, capability of a row (the run unescaped as _cell wrote it)."""
    cells = row.split(" | ")
    return cells[0].removeprefix("| "), cells[1], cells[2].replace("\\|", "|"), cells[3]


def _version_order(line: str, name: str, versions: tuple) -> int:
    version = line.removeprefix(f"Rows of {name} ").partition(" last run:")[0]
    return versions.index(version) if version in versions else len(versions)


def update(
    verdicts: list[Verdict], path: Path, options: str, libraries: dict = LIBRARIES, narrowed: bool = False, took_s: float | None = None
) -> None:
    """The verdicts of some library==version runs (``scripts/libraries NAME[==VERSION]``) into the
    document as it stands: the rows of each library==version run replaced, the rows ordered by the
    table's libraries and each one's pinned then older versions (the others' order kept), the
    section of each library run rewritten from its table entry with this run's date and options;
    every other row and line kept as it was."""
    if not path.exists():
        return write(verdicts, path, options, libraries, took_s)
    lines = path.read_text().splitlines()
    # a run narrowed by --capability replaces only its own rows; a whole one every row of its version
    ran = {(v.library, v.version, v.run, v.capability) for v in verdicts} if narrowed else {(v.library, v.version) for v in verdicts}
    key = _cell_key if narrowed else _key
    rule = lines.index("|---|---|---|---|---|---|---|")
    end = rule + 1
    while end < len(lines) and lines[end].startswith("| "):
        end += 1
    names = list(libraries)

    def order(row: str) -> tuple[int, int]:
        name, version = _key(row)
        library = libraries.get(name)
        versions = (library.pinned, *library.older) if library else ()
        return (names.index(name) if name in names else len(names), versions.index(version) if version in versions else len(versions))

    rows = sorted([row for row in lines[rule + 1 : end] if key(row) not in ran] + [_row(v) for v in verdicts], key=order)
    lines[rule + 1 : end] = rows
    for name in dict.fromkeys(v.library for v in verdicts if v.library in libraries):
        heading, section = f"## {name}", _section(libraries[name])
        start = lines.index(heading) if heading in lines else len(lines)
        stop = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        # one "last run" line per version: this run's, and the earlier ones of the versions it did not run
        earlier = {
            line.removeprefix(f"Rows of {name} ").partition(" last run:")[0]: line
            for line in lines[start:stop]
            if line.startswith(f"Rows of {name} ")
        }
        today = f"{datetime.date.today().isoformat()}, {_options(options)}{_took(took_s)}"
        when = {}
        for n, version, *_ in ran:
            if n != name:
                continue
            if narrowed and version in earlier:  # the whole run's line stays; the rows rerun are said after it
                capabilities = sorted({c for m, w, _, c in ran if (m, w) == (name, version)})
                kept = earlier[version].split("; rerun alone since:")[0].rstrip(".")
                when[version] = f"{kept}; rerun alone since: the {', '.join(capabilities)} rows, {today}."
            else:
                when[version] = f"Rows of {name} {version} last run: {today}."
        for version, line in earlier.items():
            when.setdefault(version, line)
        versions = (libraries[name].pinned, *libraries[name].older)
        for line in reversed(sorted(when.values(), key=lambda line: _version_order(line, name, versions))):
            section[3:3] = [line, ""]  # a paragraph each
        at = start - 1 if 0 < start < len(lines) and lines[start - 1] == "" else start
        lines[at:stop] = section + ([""] if stop < len(lines) else [])
    path.write_text("\n".join(lines) + "\n")


def explain(path: Path, libraries: dict = LIBRARIES) -> int:
    """Every failed or refused row's last cell (why) rewritten from the table's explanations as they stand, its verdict
    and detail kept as the run wrote them (``scripts/libraries --explain``, running nothing: after an
    explanation is written, a standalone reproduction has shown a failure to be the library's, say).
    Returns how many rows changed."""
    from parallelism_conformance.harness.driver.libraries.matrix import explanation

    lines, changed = path.read_text().splitlines(), 0
    for i, row in enumerate(lines):
        if not row.startswith("| ") or row.startswith("| library |") or row.count(" | ") < 6:
            continue
        name, _, label, capability = _cell_key(row)
        library = libraries.get(name)
        run = next((r for r in (library.runs if library else ()) if r.label == label), None)
        if run is None:
            continue
        cells = row.rstrip(" |").split(" | ")
        if cells[4] not in ("**fail**", "**refused**"):  # the others' why came from the tests the run skipped
            continue
        detail = cells[5]
        test = detail.split(": ", 1)[0] if "::" in detail.split(": ", 1)[0] else ""
        why = explanation(library, run, capability, test)
        rewritten = " | ".join([*cells[:6], _cell(why)]) + " |"
        changed += rewritten != row
        lines[i] = rewritten
    path.write_text("\n".join(lines) + "\n")
    return changed


def expected_time(path: Path, name: str, version: str, options: str) -> str:
    """What the document says a run of ``name==version`` with these pytest ``options`` took last time,
    as a line to print before it starts (a version's matrix at full depth takes minutes), or what it
    has instead: the last run with other options, or none."""
    said = f"Rows of {name} {version} last run: "
    line = next((line for line in (path.read_text().splitlines() if path.exists() else ()) if line.startswith(said)), "")
    took = re.search(r", (\d+) s for the runs", line.split("; rerun alone since:")[0])
    if not line or not took:
        return f"{name}=={version}: no earlier timed run in {path.name}; no estimate"
    same = f"`{options}`" in line.split("; rerun alone since:")[0] if options else "Hypothesis profile `quick`" in line
    if same:
        return f"{name}=={version}: the last invocation that ran it with these options took {took.group(1)} s (with whatever else it ran)"
    other = re.search(r"with pytest options (`[^`]*`)", line)
    return f"{name}=={version}: the last timed invocation that ran it took {took.group(1)} s, with other options ({other.group(1) if other else 'none'})"
