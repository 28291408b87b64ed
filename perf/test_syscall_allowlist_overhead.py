"""What the allow list of a contained rank's system calls costs (harness/rank/syscall_allowlist.py,
issue 58 item 2), side by side, recorded and never asserted (a timed assertion on a shared machine
fails on load):

* per call: 200,000 ``getpid`` (a call both filters let through, which the C library no longer
  caches) in a fresh process each: no filter, the deny list alone (harness/rank/syscall_filter.py),
  both; the figure is ns per call and the ratio of both to the deny list alone. Beside it, what a
  refused call costs (``getppid``, off the list: the helper's round trip, harness/rank/refusal_reporter.py);
* per run: the contained collectives' file (conformance/test_collectives.py, or
  CONFORMANCE_ALLOWLIST_BENCH_FILES) of the bundled implementations with the allow list switched off
  (CONFORMANCE_SYSCALL_ALLOWLIST=off, the benchmark's switch: the audit then fails, since the rank
  says its filter is incomplete) and on, one pytest process each; the figure is the ratio of wall
  times. Needs root (containment).

What is asserted is what a benchmark can state exactly: the bundled implementations pass both ways.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = os.environ.get("CONFORMANCE_ALLOWLIST_BENCH_FILES", "conformance/test_collectives.py").split()
CALLS = 200_000

PER_CALL = rf"""
import ctypes, os, socket, sys, time
from parallelism_conformance.harness.rank import syscall_allowlist, syscall_filter
how, call = sys.argv[1], getattr(os, sys.argv[2])
server = socket.create_server(("127.0.0.1", 0)); port = server.getsockname()[1]
store = socket.create_connection(("127.0.0.1", port)); peer, _ = server.accept()
assert ctypes.CDLL(None).prctl(38, 1, 0, 0, 0) == 0
fd = syscall_filter.store_descriptor(port)
if how == "both":
    reporter = syscall_allowlist.install()  # kept: its socket closed, the helper leaves
if how != "none":
    syscall_filter.install(fd)
best = float("inf")
for _ in range(5):
    started = time.perf_counter_ns()
    for _ in range({CALLS}):
        try:
            call()
        except OSError:
            pass
    best = min(best, time.perf_counter_ns() - started)
print(best / {CALLS})
"""


def _per_call(how: str, call: str = "getpid") -> float:
    done = subprocess.run([sys.executable, "-c", PER_CALL, how, call], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


def test_a_call_through_both_filters_against_the_deny_list_alone(figures):
    times = {how: _per_call(how) for how in ("none", "deny", "both")}
    ratio = times["both"] / times["deny"]
    refused = _per_call("both", "getppid")
    print(
        f"\ngetpid, best of 5 x {CALLS}: {times['none']:.0f} ns unfiltered, {times['deny']:.0f} ns under the deny list, "
        f"{times['both']:.0f} ns under both ({ratio:.2f}x the deny list alone); a refused call (getppid): {refused:.0f} ns"
    )
    figures.record(
        "allow list: ns per allowed system call, both filters against the deny list",
        f"{ratio:.2f}x ({times['both']:.0f} ns against {times['deny']:.0f} ns)",
    )


def _contained_run(allowlist: str) -> tuple[float, int, str]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *FILES, "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--contain-ranks", "yes"]
        + ["--impl", "parallelism_conformance.impls", "--hypothesis-profile=ci"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, CONFORMANCE_SYSCALL_ALLOWLIST=allowlist),
    )
    return time.perf_counter() - started, done.returncode, done.stdout[-3000:]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="contained ranks need root")
def test_a_contained_run_with_the_allow_list_against_one_without(figures):
    off_s, off_code, off_tail = _contained_run("off")
    on_s, on_code, on_tail = _contained_run("on")
    ratio = on_s / off_s
    what = " ".join(FILES)
    print(
        f"\n{what}, contained, the bundled implementations on the ci profile: {off_s:.0f} s without the allow list, {on_s:.0f} s with it ({ratio:.2f}x)"
    )
    figures.record(f"allow list: {what} contained, on against off", f"{ratio:.2f}x ({on_s:.0f} s against {off_s:.0f} s)")
    assert off_code == 0 and on_code == 0, off_tail + on_tail
