"""The resumed run continues the first replica's stream only (Megatron-Bridge#5637: a DP=2 run resumed at DP=1 kept rank 0's loader state and silently dropped rank 1's): it skips the indices replica 0 had consumed, the world's count divided by the replicas of the resumed run, and deals out the epoch's order from there, so samples consumed by other replicas are seen again and others skipped.
targets: test_a_run_resumed_at_another_size_sees_every_sample_once
"""

import parallelism_conformance.impls.data_sampling as _bundled
from parallelism_conformance.impls import *


class DistributedSampler(_bundled.DistributedSampler):
    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False, consumed_samples=0):
        replicas = num_replicas or 1
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last, consumed_samples=consumed_samples // replicas)
