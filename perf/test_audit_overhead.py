"""What the communication audit costs: one collective task on a warm world, plain (gloo) against
audited (every rank on the recording backend of harness/rank/recording.py, its records sent back with
the result), side by side in one run, for the bundled point-to-point all_reduce (2(n-1) sends and
2(n-1) receives per rank, each recorded through the Python ProcessGroup) and for gloo's own
all_reduce (one recorded call), at n=2 and n=4; audited on gloo (the rank's own records: a library
adapter's audit) and through the driver's relay (harness/driver/relay.py: every implementation
under test but a library's adapter, its evidence out of the rank's reach).

The two pools are timed interleaved, round by round, which one goes first alternating, so load from
other processes on the shared machine hits both alike; pytest-benchmark reports the audited task,
the plain median is in extra_info. The gate is the median of the per-round ratios (audited over
plain, the two tasks of a round back to back); the ratio of lower quartiles and of medians are
printed too. It was the ratio of lower quartiles, with plain always first, until it missed
narrowly in three of eight runs (1.25-1.35x) where the same benchmark on an older commit, run
alternately, did as well. Goal: the audit adds at most a quarter to a warm task.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from parallelism_conformance.harness.driver.pool import WorldPool

CALL = "parallelism_conformance.harness.rank.programs.collectives:call"
ROUNDS = 80
OVERHEAD_GOAL = 1.25


def example(n: int) -> list[dict]:
    return [{"function": "all_reduce", "arguments": {"tensor": torch.randn(1024), "op": "SUM"}, "group": None} for _ in range(n)]


@pytest.mark.parametrize("transport", ["gloo", "relay"])
@pytest.mark.parametrize("impl", ["parallelism_conformance.impls", "torch.distributed"])
@pytest.mark.parametrize("n", [2, 4])
def test_audited_task_against_a_plain_one(benchmark, figures, n, impl, transport):
    args = example(n)
    with WorldPool("gloo") as plain, WorldPool("gloo", audit=True, relay=transport == "relay") as audited:
        for pool in (plain, audited):  # start and warm up
            for _ in range(5):
                pool.run(n, CALL, args, impl=impl)
        times = {"plain": [], "audited": []}
        records = 0
        for round_ in range(ROUNDS):  # alternate which goes first: no systematic order effect
            pools = (("plain", plain), ("audited", audited))
            for name, pool in pools if round_ % 2 else pools[::-1]:
                started = time.perf_counter()
                result = pool.run(n, CALL, args, impl=impl)
                times[name].append(time.perf_counter() - started)
                if name == "audited":
                    carried = result.relayed.records.values() if result.relayed is not None else result.records
                    records = sum(len(r) for r in carried)
        benchmark.pedantic(lambda: audited.run(n, CALL, args, impl=impl), rounds=ROUNDS, warmup_rounds=3)
    plain_s, audited_s = statistics.median(times["plain"]), statistics.median(times["audited"])
    plain_q, audited_q = (statistics.quantiles(times[k], n=4)[0] for k in ("plain", "audited"))
    ratio_p25 = audited_q / plain_q
    # the gate: the median of the per-round ratios (a round's two tasks share the machine's load of
    # the moment, as the ring benchmark's pairs do), not a ratio of two separate statistics
    ratio = statistics.median(a / p for p, a in zip(times["plain"], times["audited"]))
    benchmark.extra_info.update(
        plain_s=plain_s,
        audited_s=audited_s,
        plain_p25_s=plain_q,
        audited_p25_s=audited_q,
        ratio_p25=ratio_p25,
        ratio_median=audited_s / plain_s,
        ratio_paired=ratio,
        records_per_task=records,
    )
    print(
        f"\n{impl} all_reduce of 1024 float32, n={n}, audited on {transport} ({records} records per task): median plain {plain_s * 1e3:.2f} ms, "
        f"audited {audited_s * 1e3:.2f} ms ({audited_s / plain_s:.2f}x); lower quartile plain {plain_q * 1e3:.2f} ms, "
        f"audited {audited_q * 1e3:.2f} ms ({ratio_p25:.2f}x); median of the per-round ratios {ratio:.2f}x"
    )
    figures.record(
        f"communication audit{' through the relay' if transport == 'relay' else ''}, audited against plain task, {impl}, n={n} (median of per-round ratios)",
        f"{ratio:.2f}x ({records} records per task)",
        f"<= {OVERHEAD_GOAL}x",
        ratio <= OVERHEAD_GOAL,
    )
    assert ratio <= OVERHEAD_GOAL, f"the audit makes a warm task {ratio:.2f}x slower, goal <= {OVERHEAD_GOAL}x"
