"""The summary of a run's grading files (summary.txt, and results.json's ``output``): a header, a row
per claimed capability, the notes (incomplete, not graded, hidden), and the points lost, as text or
Markdown. Built by harness/driver/reports.py from the graded entries."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

from parallelism_conformance.harness.driver.failures import NOT_GRADED
from parallelism_conformance.harness.driver.rubric import Rubric
from parallelism_conformance.harness.driver.scorecard import TestResult


@dataclass
class Summary:
    """What summary.txt and results.json's ``output`` say, before it is written as text or Markdown."""

    header: list[tuple[str, str]]
    rows: list[tuple[str, tuple[int, int] | None, tuple[int, int, int], str]]  # name, (got, max) cents or not run, counts, note
    total: tuple[int, int] | None  # None: withheld
    notes: list[str] = field(default_factory=list)
    lost: list[tuple[str, str]] = field(default_factory=list)  # test name, headline


def withheld(visibility: str, output_visibility: str) -> bool:
    """Whether a test's result must be left out of the summary students see: it is shown later than
    the summary or never (Gradescope hides the total too when tests are hidden)."""
    return visibility not in ("visible", output_visibility)


def summarize(
    rows: dict[str, list[TestResult]],
    pairs: list[tuple[TestResult, dict]],
    totals: dict[str, tuple[int, int]],
    rubric: Rubric,
    header: list[tuple[str, str]],
    *,
    complete: bool,
    for_students: bool,
    claimed=None,
) -> Summary:
    """The summary. For students (results.json's ``output``), the rows and failures of tests
    shown later than the summary, or never, are left out, and so is the total."""
    shown = rubric.default_visibility()
    hidden = {r.nodeid for r, entry in pairs if for_students and withheld(entry["visibility"], shown)}
    hidden_rows = {r.capability for r, _ in pairs if r.nodeid in hidden}
    if for_students:
        hidden_rows |= {c for c in rubric if withheld(rubric.visibility_of(c), shown)}
    table = []
    for capability in (c for c in totals if c not in hidden_rows):
        results = rows[capability]
        count = tuple(sum(r.outcome == k for r in results) for k in ("passed", "failed", "skipped"))
        table.append((capability, totals[capability], count, "" if capability in rubric else "not in the rubric: 0 points"))
    # a claimed capability none of whose tests reported is "not run"; one the course did not claim is not listed
    claimed = set(rubric) if claimed is None else set(claimed)
    table += [(c, None, (0, 0, 0), "") for c in sorted((set(rubric) & claimed) - set(totals) - hidden_rows)]
    total = None if hidden_rows else (sum(s for s, _ in totals.values()), sum(m for _, m in totals.values()))
    notes = [] if complete else ["INCOMPLETE: the run has not finished (or was stopped from outside); what is above is what had finished"]
    not_graded = [r for r, _ in pairs if r.outcome == "skipped" and r.output.startswith(NOT_GRADED) and r.nodeid not in hidden]
    if not_graded:
        notes.append(
            f"{len(not_graded)} test(s) not graded, counted neither for nor against: the kernel killed a rank for memory "
            "even with every other world closed (the container's memory tier, not the implementation)"
        )
    if hidden_rows:
        many = "capability is" if len(hidden_rows) == 1 else "capabilities are"
        notes.append(f"{len(hidden_rows)} {many} shown later or not at all (their visibility), and so is the total")
    lost = [(entry["name"], _headline(r.output)) for r, entry in pairs if entry["status"] == "failed" and r.nodeid not in hidden]
    return Summary(header, table, total, notes, lost)


def as_text(summary: Summary) -> str:
    lines = [f"{key}: {value}" for key, value in summary.header]
    lines += ["", f"{'capability':<24} {'points':>13}  tests (passed/failed/skipped)"]
    for name, points, count, note in summary.rows:
        if points is None:
            lines.append(f"{name:<24} {'not run':>13}")
            continue
        unrated = f"  ({note})" if note else ""
        lines.append(f"{name:<24} {points[0] / 100:6.2f}/{points[1] / 100:6.2f}  {'/'.join(map(str, count))}{unrated}")
    lines += ["", f"total: {summary.total[0] / 100:.2f}/{summary.total[1] / 100:.2f}" if summary.total else "total: shown later"]
    for note in summary.notes:
        lines += ["", note]
    if summary.lost:
        lines += ["", "lost points:"] + [f"- {name}: {headline}" for name, headline in summary.lost]
    return "\n".join(lines) + "\n"


def as_markdown(summary: Summary) -> str:
    """The summary as Markdown: the header as a list, the capabilities as a table."""
    lines = [f"- {key}: {_code(value)}" for key, value in summary.header]
    lines += ["", "| capability | points | passed | failed | skipped |", "|---|---:|---:|---:|---:|"]
    for name, points, count, note in summary.rows:
        shown = "not run" if points is None else f"{points[0] / 100:.2f}/{points[1] / 100:.2f}"
        cells = ("", "", "") if points is None else count
        lines.append(f"| {name}{f' ({note})' if note else ''} | {shown} | " + " | ".join(map(str, cells)) + " |")
    lines += ["", f"**total: {summary.total[0] / 100:.2f}/{summary.total[1] / 100:.2f}**" if summary.total else "**total: shown later**"]
    for note in summary.notes:
        lines += ["", note]
    if summary.lost:
        lines += ["", "lost points:", ""] + [f"- {_code(name)}: {_code(headline)}" for name, headline in summary.lost]
    return "\n".join(lines) + "\n"


def _code(text: str) -> str:
    """A Markdown code span that shows ``text`` literally: fenced by one more backtick than its
    longest run (CommonMark), padded when it starts or ends with one."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{'`' * (longest + 1)}{pad}{text}{pad}{'`' * (longest + 1)}"


def rendered(summary: Summary, output_format: str) -> str:
    """The summary in results.json's ``output_format``: Markdown's own table for md, the text in a
    <pre> for HTML (its columns need a fixed-width font), the text otherwise."""
    if output_format == "md":
        return as_markdown(summary)
    if output_format == "html":
        return f"<pre>{html.escape(as_text(summary))}</pre>"
    return as_text(summary)


def _headline(output: str) -> str:
    """A failure's first line, and the example it happened on (dtype, op, world size: the judge's
    "example:" line), on one line."""
    lines = output.splitlines()
    if not lines:
        return "failed"
    example = next((line.strip() for line in lines[1:] if line.strip().startswith("example:")), "")
    return lines[0] + (f" [{example}]" if example else "")
