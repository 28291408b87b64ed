"""consumed_samples is accepted and ignored: the resumed run starts the epoch again, so every sample the first run consumed is seen twice.
targets: test_a_run_resumed_at_another_size_sees_every_sample_once
"""

import parallelism_conformance.impls.data_sampling as _bundled
from parallelism_conformance.impls import *


class DistributedSampler(_bundled.DistributedSampler):
    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False, consumed_samples=0):
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
