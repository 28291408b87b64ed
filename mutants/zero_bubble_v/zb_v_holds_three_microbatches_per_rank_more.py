"""generate_schedule("zb-v") lets each rank run forwards while it holds fewer than 2p + 3 stage activations instead of 2p: the bubble is as small, the memory is not ZB-V's.
targets: generated_zb_v

The paper's point for the V is zero bubble at 1F1B's activation memory (p microbatches: 2p stages
of half a rank's layers). A warm-up that runs further ahead loses no time and so passes a check
of the bubble alone; only the peak live activations show it.
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank=1):
    if kind != "zb-v" or stages_per_rank != 2:
        return _bundled.generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank)
    p = num_ranks
    owner = _bundled._owner(p, "v")
    compute = _bundled._zb_v(p, num_microbatches, cap=2 * p + 3)
    return [_bundled._with_communication(row, r, owner, 2 * p) for r, row in enumerate(compute)]
