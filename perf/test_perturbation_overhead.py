"""What --perturb-timing costs: the whole conformance run of the bundled implementations on the ci
profile without it and with it, side by side in one run (one pytest process each, the order
alternating round by round), on the same machine, the same draws and the same worlds. The figure
is the ratio of their wall times; the goal of issue 48 is at most 1.5x. It is recorded with the
goal, never asserted: a timed assertion on a shared 2-core machine would fail on load. What is
asserted is what a benchmark can state exactly: the known-good implementations pass both ways.

CONFORMANCE_PERTURB_BENCH_FILES (space separated) narrows the run to some conformance files, for a
quicker look; the figure then says which.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = os.environ.get("CONFORMANCE_PERTURB_BENCH_FILES", "conformance").split()
ROUNDS = int(os.environ.get("CONFORMANCE_PERTURB_BENCH_ROUNDS", "1"))
GOAL = 1.5


def conformance_run(mode: str) -> tuple[float, int, str]:
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *FILES,
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "--impl",
            "parallelism_conformance.impls",
            "--hypothesis-profile=ci",
            "--perturb-timing",
            mode,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return time.perf_counter() - started, done.returncode, done.stdout[-3000:]


def test_a_perturbed_conformance_run_against_an_unperturbed_one(figures):
    times: dict[str, list[float]] = {"off": [], "on": []}
    failed = []
    for round_ in range(ROUNDS):
        for mode in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            seconds, code, tail = conformance_run(mode)
            times[mode].append(seconds)
            if code != 0:
                failed.append(f"--perturb-timing {mode}: pytest exit {code}\n{tail}")
    off, on = min(times["off"]), min(times["on"])
    ratio = on / off
    what = " ".join(FILES)
    print(
        f"\n{what} on the ci profile, --impl parallelism_conformance.impls: {off:.0f} s without --perturb-timing, {on:.0f} s with it "
        f"({ratio:.2f}x; fastest of {ROUNDS} round(s) each)"
    )
    figures.record(
        f"--perturb-timing: {what} of the bundled implementations on the ci profile, on against off",
        f"{ratio:.2f}x ({on:.0f} s against {off:.0f} s, fastest of {ROUNDS})",
        f"<= {GOAL}x",
        ratio <= GOAL,
    )
    assert not failed, "\n".join(failed)
