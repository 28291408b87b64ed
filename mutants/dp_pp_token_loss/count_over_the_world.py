"""global_token_count ignores its group and sums over the default group, the whole world: on a pp x dp mesh only the last stages count, so the others never join the all-reduce and the last stages wait for them (a count of the world where the data-parallel group is meant).
bug: hang
targets: test_pipelines_over_data_parallel_replicas_normalise_by_the_global_count
"""

import parallelism_conformance.impls.token_loss as _bundled
from parallelism_conformance.impls import *


def global_token_count(local_count, group=None):
    return _bundled.global_token_count(local_count, None)
