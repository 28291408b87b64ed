"""generate_schedule("zb-h1") returns plain 1F1B, backward unsplit: valid, right, and none of the bubble removed.
targets: generated_zb_h1

A student who has not read the paper maps the new name to the schedule they already have.
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank=1):
    return _bundled.generate_schedule("1f1b" if kind == "zb-h1" else kind, num_ranks, num_microbatches, stages_per_rank)
