"""generate_schedule("zb-v") builds the right compute order but places its sends and receives as if stage s lived on rank s % p.
targets: generated_zb_v or zb_v_step

The communication pass left from the loop placement: in the V, stage p lives on rank p - 1 (the
bottom of the V, where the activations turn) and stage 2p - 1 on rank 0, so the loop's peers are
wrong for the whole second arm: sends to ranks that never receive them, receives that never come.
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank=1):
    if kind != "zb-v" or stages_per_rank != 2:
        return _bundled.generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank)
    p = num_ranks
    loop = _bundled._owner(p, "loop")
    return [_bundled._with_communication(row, r, loop, 2 * p) for r, row in enumerate(_bundled._zb_v(p, num_microbatches))]
