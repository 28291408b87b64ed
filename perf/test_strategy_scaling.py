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
