"""ZB-H1's generator defers rank r's W passes by p - 1 - r microbatches instead of r: the first rank holds 2p - 1 activations, not p.
targets: generated_zb_h1

Reading the paper's figure from the wrong end: the rank with the longest warm-up also gets the
longest deferral. The schedule is valid and deadlock-free and training is right, but rank 0 holds
more activations than 1F1B's peak and the bubble is not (p - 1)(T_F + T_I - T_W).
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank=1):
    if kind != "zb-h1":
        return _bundled.generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank)
    p, m = num_ranks, num_microbatches
    rows = []
    for r in range(p):
        warmup, delay = min(p - 1 - r, m), p - 1 - r
        row, deferred = [(r, "F", i) for i in range(warmup)], list(range(m))
        for k in range(warmup, m):
            row += [(r, "F", k), (r, "I", k - warmup)]
            if k - warmup >= delay:
                row.append((r, "W", deferred.pop(0)))
        for k in range(m - warmup, m):
            row.append((r, "I", k))
            if deferred and deferred[0] <= k:
                row.append((r, "W", deferred.pop(0)))
        rows.append(_bundled._with_communication(row + [(r, "W", i) for i in deferred], r, p, p))
    return rows
