"""The 1F1B generator's warm-up is one forward too short (p - 2 - r instead of p - 1 - r): more bubble, wrong memory.
targets: generated_schedules

Rank r runs max(0, min(p - 2 - r, m)) forwards before its first backward. The schedule is still
valid and deadlock-free, so training stays correct, but rank p - 2 now waits for every gradient
before its next forward: the bubble exceeds (p - 1)/(m + p - 1) and the live activations are not
min(m, p - r).
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank=1):
    if kind != "1f1b":
        return _bundled.generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank)
    p, m = num_ranks, num_microbatches
    rows = []
    for r in range(p):
        warmup = max(0, min(p - 2 - r, m))  # bug: p - 2 - r
        compute = [(r, "F", i) for i in range(warmup)]
        for k in range(m - warmup):
            compute += [(r, "F", warmup + k), (r, "B", k)]
        compute += [(r, "B", k) for k in range(m - warmup, m)]
        rows.append(_bundled._with_communication(compute, r, p, p))
    return rows
