"""consumed_samples is taken as this replica's own position: each resumed replica skips that many of its own indices of the epoch dealt out at the new size, instead of the world's count of the epoch's order, so most of what the first run had not reached is never seen.
targets: test_a_run_resumed_at_another_size_sees_every_sample_once
"""

import math

import parallelism_conformance.impls.data_sampling as _bundled
from parallelism_conformance.impls import *


class DistributedSampler(_bundled.DistributedSampler):
    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False, consumed_samples=0):
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self.skip = consumed_samples

    def __len__(self):
        return max(0, super().__len__() - self.skip)

    def __iter__(self):
        mine = list(super().__iter__())
        return iter(mine[self.skip :])
