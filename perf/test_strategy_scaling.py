"""The lecture's experiment for strategies: a fixed global problem, more ranks. Step time measured
inside the ranks (max over ranks) against world size, the bundled implementation beside torch's
own, and the scaling efficiency t(1) / (n * t(n)) printed. (Pipeline bubble against theory:
perf/test_pipeline_bubble.py.)

On 2 CPU cores more ranks cannot run faster; these figures are for comparing implementations run
side by side, and for GPU runners where each rank has its own device.
"""
from __future__ import annotations

import pytest

from perf.conftest import world_sizes

TIMING = "harness.programs.timing"
TP_IMPLS = ("impls", "adapters.dtensor_tp")
# (label, implementation, bucket_size_mb): naive, overlapped (per-gradient hooks), bucketed, DDP.
DP_VARIANTS = (("naive", "impls.naive_dp", None), ("overlapped", "impls", None), ("bucketed", "impls", 4.0),
               ("torch DDP", "adapters.torch_native", 4.0))
DP_WIDTH, DP_DEPTH, DP_BATCH = 512, 6, 64  # 1.6 M parameters, 6.3 MB of gradients per step
DP_GOAL = 1.2  # bucketed within 1.2x of DDP at n=4
HIDDEN, FFN, TOKENS = 256, 1024, 512


def ranks_time(world_pool, program: str, impl: str, n: int, **arguments) -> float:
    result = world_pool.run(n, f"{TIMING}:{program}", [arguments] * n, impl=impl)
    return max(out["seconds"] for out in result.outputs)


def test_tensor_parallel_mlp_scaling(world_pool, pytestconfig, benchmark):
    """TP MLP forward+backward at fixed dimensions: bundled against DTensor, n = the perf world sizes."""
    sizes = [n for n in world_sizes(pytestconfig) if FFN % n == 0]
    times = {}

    def sweep():
        for n in sizes:
            for impl in TP_IMPLS:
                times[(impl, n)] = ranks_time(world_pool, "time_tensor_parallel_mlp", impl, n,
                                              hidden=HIDDEN, ffn=FFN, tokens=TOKENS, iters=5)

    benchmark.pedantic(sweep, rounds=1, iterations=1)
    lines = [f"\nTP MLP fwd+bwd, hidden={HIDDEN} ffn={FFN} tokens={TOKENS} (ms, max over ranks; efficiency t1/(n*tn)):"]
    for impl in TP_IMPLS:
        base = times[(impl, sizes[0])] * sizes[0]
        row = "  ".join(f"n={n}: {times[(impl, n)] * 1e3:7.2f} ({base / (n * times[(impl, n)]):.2f})" for n in sizes)
        lines.append(f"  {impl:<22}{row}")
    for n in sizes:
        lines.append(f"  n={n}: bundled / DTensor = {times[('impls', n)] / times[('adapters.dtensor_tp', n)]:.2f}")
    print("\n".join(lines))
    benchmark.extra_info.update({f"{impl} n={n}": t for (impl, n), t in times.items()})


def test_data_parallel_step_scaling(world_pool, pytestconfig, benchmark):
    """DP step time for a fixed global batch: naive, overlapped, bucketed and torch DDP side by side,
    as ratios to DDP; gate: bucketed within 1.2x of DDP at the largest world size (4 by default)."""
    sizes = [n for n in world_sizes(pytestconfig) if DP_BATCH % n == 0]
    times = {}

    def sweep():
        for n in sizes:
            for _ in range(2):  # alternate the variants twice, keep each one's best
                for label, impl, bucket in DP_VARIANTS:
                    t = ranks_time(world_pool, "time_data_parallel_step", impl, n, width=DP_WIDTH, depth=DP_DEPTH,
                                   global_batch=DP_BATCH, bucket_size_mb=bucket, iters=5)
                    times[(label, n)] = min(t, times.get((label, n), float("inf")))

    benchmark.pedantic(sweep, rounds=1, iterations=1)
    lines = [f"\nDP step, MLP {DP_DEPTH}x{DP_WIDTH}, global batch {DP_BATCH} (ms, max over ranks; ratio to DDP):"]
    for label, _, _ in DP_VARIANTS:
        row = "  ".join(f"n={n}: {times[(label, n)] * 1e3:7.1f} ({times[(label, n)] / times[('torch DDP', n)]:.2f}x)"
                        for n in sizes)
        lines.append(f"  {label:<12}{row}")
    print("\n".join(lines))
    benchmark.extra_info.update({f"{label} n={n}": t for (label, n), t in times.items()})
    largest = sizes[-1]
    ratio = times[("bucketed", largest)] / times[("torch DDP", largest)]
    assert ratio <= DP_GOAL, f"bucketed DP takes {ratio:.2f}x torch DDP's step time at n={largest}, goal <= {DP_GOAL}x"
