"""Benchmarks: run with scripts/bench (pytest-benchmark). Each prints the ratio it is judged on.

The collective benchmarks record the time the ranks measured (max over ranks), not the driver's
round trip; at the end of the run this file prints an nccl-tests-like table with the alpha-beta
model beside each measurement and writes the plots (PNG) to --perf-out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parallelism_conformance.perf import figures as measured_table
from parallelism_conformance.perf.bandwidth import Measurement, plot, table

MEASUREMENTS = pytest.StashKey[list]()
FIGURES = pytest.StashKey[measured_table.Figures]()
UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3}


def _bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def pytest_addoption(parser):
    group = parser.getgroup("perf")
    group.addoption(
        "--perf-sizes", default="4K,256K,16M,64M", help="message sizes to sweep (default 4K,256K,16M,64M; --perf-full: 4K..64M by 4x)"
    )
    group.addoption("--perf-world-sizes", default="1,2,3,4", help="world sizes to sweep (default 1,2,3,4; 8 on request)")
    group.addoption("--perf-full", action="store_true", help="sweep 4 KiB to 64 MiB in steps of 4x")
    group.addoption("--perf-out", default=str(Path(__file__).parent / "out"), help="where the plots go")
    group.addoption(
        "--grading-tiers",
        nargs="?",
        const="all",
        default=None,
        metavar="CPUS/MIB:SUBMISSION,...",
        help="run the autograder tier benchmark (perf/test_grading_tiers.py): every row, or those named",
    )
    group.addoption(
        "--write-measured",
        default=None,
        metavar="FILE",
        help="write the figures of this run into FILE's measured table (scripts/bench: docs/measured.md)",
    )


def pytest_configure(config):
    config.stash[MEASUREMENTS] = []
    config.stash[FIGURES] = measured_table.Figures()


def sizes(config) -> list[int]:
    if config.getoption("--perf-full"):
        return [4096 * 4**k for k in range(8)]
    return [_bytes(s) for s in config.getoption("--perf-sizes").split(",")]


def world_sizes(config) -> list[int]:
    return [int(n) for n in config.getoption("--perf-world-sizes").split(",")]


@pytest.fixture(scope="session")
def measurements(pytestconfig) -> list[Measurement]:
    return pytestconfig.stash[MEASUREMENTS]


@pytest.fixture(scope="session")
def figures(pytestconfig) -> measured_table.Figures:
    """Where a benchmark records the figure it is judged on (perf/figures.py)."""
    return pytestconfig.stash[FIGURES]


def pytest_terminal_summary(terminalreporter, config):
    recorded = config.stash.get(FIGURES, None)
    if recorded is not None and recorded.recorded:
        terminalreporter.section("figures of this run")
        for line in recorded.lines():
            terminalreporter.write_line(line)
        target = config.getoption("--write-measured")
        if target:
            measured_table.write(Path(target), recorded)
            terminalreporter.write_line(f"written to {target}")
    measured = config.stash.get(MEASUREMENTS, [])
    if not measured:
        return
    terminalreporter.section("collectives: time measured in the ranks (max over ranks)")
    terminalreporter.write_line(table(measured, native="torch.distributed"))
    try:
        written = plot(measured, Path(config.getoption("--perf-out")))
    except ImportError:
        terminalreporter.write_line("(matplotlib is not installed: no plots; pip install matplotlib)")
        return
    terminalreporter.write_line("plots: " + ", ".join(str(p) for p in written))
