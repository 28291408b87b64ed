"""The measured table: each benchmark records the figure it is judged on, and scripts/bench writes
them into docs/measured.md between two markers, so that table is never edited by hand.

A row is keyed by its benchmark's text. Rows of benchmarks this run did not reach are kept as they
were, with the date and commit they were measured on; a rerun replaces its own rows only.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

BEGIN = "<!-- scripts/bench writes the table below; do not edit it by hand -->"
END = "<!-- end of the table scripts/bench writes -->"
HEADER = ["benchmark", "figure", "goal", "measured"]


@dataclass(frozen=True)
class Figure:
    benchmark: str  # what was measured, side by side with what (the row's key)
    figure: str  # the ratio it is judged on, with what it came from
    goal: str = ""  # the gate, "" when the figure is only reported
    met: bool | None = None  # None: no gate

    def cells(self, when: str) -> list[str]:
        goal = self.goal if self.met is None else f"{self.goal}: {'met' if self.met else 'MISSED'}"
        return [self.benchmark, self.figure, goal, when]


class Figures:
    """What a benchmark session measured, in the order recorded (the ``figures`` fixture)."""

    def __init__(self):
        self.recorded: dict[str, Figure] = {}

    def record(self, benchmark: str, figure: str, goal: str = "", met: bool | None = None) -> None:
        self.recorded[benchmark] = Figure(benchmark, figure, goal, met)

    def lines(self) -> list[str]:
        return [" | ".join(f.cells("")[:3]) for f in self.recorded.values()]


def stamp() -> str:
    """Today's date and the commit measured (with '+' when the working tree has changes)."""
    root = Path(__file__).parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    return f"{datetime.date.today().isoformat()} {commit}{'+' if dirty else ''}".strip()


def machine() -> str:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"{os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}, {gpus} GPU{'s' if gpus != 1 else ''} visible"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |"


def _parse(block: list[str]) -> dict[str, list[str]]:
    rows = {}
    for line in block:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == len(HEADER) and cells != HEADER and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = cells
    return rows


def write(path: Path, figures: Figures) -> None:
    """Replace the rows this run measured in ``path``'s table (the file and its markers are made
    when missing), keep the others, and say on which machine the last run was."""
    text = path.read_text() if path.exists() else f"# Measured\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip("\n") + f"\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    block, tail = rest.split(END, 1)
    rows = _parse(block.splitlines())
    when = stamp()
    for figure in figures.recorded.values():
        rows[figure.benchmark] = figure.cells(when)
    lines = [
        f"Last written by `scripts/bench` on {when}, on {machine()}.",
        "",
        _row(HEADER),
        _row(["---"] * len(HEADER)),
        *(_row(cells) for cells in rows.values()),
    ]
    path.write_text(f"{head}{BEGIN}\n" + "\n".join(lines) + f"\n{END}{tail}")
