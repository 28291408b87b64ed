"""What the flight recorder costs (harness/rank/flight_recorder.py, on in every run): one collective task
on a warm world with the recorder off against on, side by side in one run, interleaved round by
round, for the bundled point-to-point all_reduce (2(n-1) sends and receives per rank, each written
to the ring with its source line) and gloo's own all_reduce (one call), at n=2 and n=4, in alternating
order. On the shared 2-core machine that ratio wanders by +-15% between runs (measured 0.84-1.32x
for an overhead far below it), so it gates only gross regressions (<= 1.5x). The goal of issue 18,
under 10% of a small collective example, is gated on what the recorder adds per task, measured in
one process without the noise of other ranks: (calls per task) x (cost of one recorded call, the
wrapper and the slot write) against the task's time.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from parallelism_conformance.harness.driver.pool import WorldPool

CALL = "parallelism_conformance.harness.rank.programs.collectives:call"
ROUNDS = 80
SIDE_BY_SIDE_LIMIT = 1.5
OVERHEAD_GOAL = 0.10


def example(n: int) -> list[dict]:
    return [{"function": "all_reduce", "arguments": {"tensor": torch.randn(1024), "op": "SUM"}, "group": None} for _ in range(n)]


@pytest.mark.parametrize("impl", ["parallelism_conformance.impls", "torch.distributed"])
@pytest.mark.parametrize("n", [2, 4])
def test_recorded_task_against_an_unrecorded_one(benchmark, figures, n, impl):
    args = example(n)
    with WorldPool("gloo", flight_recorder=False) as off, WorldPool("gloo") as on:
        for pool in (off, on):
            for _ in range(5):
                pool.run(n, CALL, args, impl=impl)
        times = {"off": [], "on": []}
        for round_ in range(ROUNDS):  # alternate which goes first: no systematic order effect
            for name, pool in (("off", off), ("on", on)) if round_ % 2 else (("on", on), ("off", off)):
                started = time.perf_counter()
                pool.run(n, CALL, args, impl=impl)
                times[name].append(time.perf_counter() - started)
        benchmark.pedantic(lambda: on.run(n, CALL, args, impl=impl), rounds=ROUNDS, warmup_rounds=3)
    off_q, on_q = (statistics.quantiles(times[k], n=4)[0] for k in ("off", "on"))
    off_m, on_m = statistics.median(times["off"]), statistics.median(times["on"])
    ratio = on_q / off_q
    benchmark.extra_info.update(off_p25_s=off_q, on_p25_s=on_q, ratio_p25=ratio, ratio_median=on_m / off_m)
    print(
        f"\n{impl} all_reduce of 1024 float32, n={n}: lower quartile without the recorder {off_q * 1e3:.2f} ms, "
        f"with {on_q * 1e3:.2f} ms ({ratio:.2f}x); medians {off_m * 1e3:.2f} / {on_m * 1e3:.2f} ms "
        f"({on_m / off_m:.2f}x)"
    )
    assert ratio <= SIDE_BY_SIDE_LIMIT, f"the flight recorder makes a warm task {ratio:.2f}x slower"
    calls = CALLS_PER_RANK[impl](n)
    share = calls * recorded_call_seconds() / off_q
    print(
        f"  {calls} recorded calls per rank x {recorded_call_seconds() * 1e6:.1f} us = "
        f"{share * 100:.2f}% of the task (goal < {OVERHEAD_GOAL * 100:.0f}%)"
    )
    benchmark.extra_info.update(recorder_share=share)
    figures.record(
        f"flight recorder: its share of a warm task, {impl}, n={n}",
        f"{share * 100:.2f}% ({calls} calls x {recorded_call_seconds() * 1e6:.1f} us); side by side {ratio:.2f}x",
        f"< {OVERHEAD_GOAL * 100:.0f}%",
        share < OVERHEAD_GOAL,
    )
    assert share < OVERHEAD_GOAL


# the bundled ring all-reduce: n-1 sends and n-1 receives in each of its two phases; gloo's: one call
CALLS_PER_RANK = {"parallelism_conformance.impls": lambda n: 4 * (n - 1), "torch.distributed": lambda n: 1}


def recorded_call_seconds() -> float:
    """One recorded send through the wrapper (harness/rank/flight_recorder.py), median of 5 x 2000."""
    import tempfile
    import timeit

    from parallelism_conformance.harness.rank.flight_recorder import Recorder, _wrap

    with tempfile.TemporaryDirectory() as folder:
        recorder = Recorder(f"{folder}/ring", 0)
        recorder.begin_task(1)
        group = object()
        recorder._groups[id(group)] = (0, 1)
        send = _wrap(recorder, "send", 0, lambda group, *args, **kwargs: None)
        tensors = [torch.ones(256)]
        return statistics.median(timeit.repeat(lambda: send(group, tensors, 1, 0), number=2000, repeat=5)) / 2000
