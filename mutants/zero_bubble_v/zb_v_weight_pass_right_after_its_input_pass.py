"""generate_schedule("zb-v") runs every W right after its I: the V placement without the deferred weight passes, so its bubble is not filled.
targets: generated_zb_v

A ZB-V whose author split the backward but never deferred the weight gradient: valid, deadlock-free,
every gradient right, and the makespan of a V-shaped 1F1B, not the paper's 6m + p - 1.
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank=1):
    rows = _bundled.generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank)
    if kind != "zb-v":
        return rows
    out = []
    for row in rows:
        weights = [a for a in row if "W" in a]
        kept = []
        for action in row:
            if "W" in action:
                continue
            kept.append(action)
            if "I" in action:
                kept.append(action.replace("I", "W"))
        assert len(weights) == sum("W" in a for a in kept)
        out.append(kept)
    return out
