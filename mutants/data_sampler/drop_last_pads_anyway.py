"""DistributedSampler pads the epoch with repeats even with drop_last: some samples are seen twice in an epoch that should see each at most once (accelerate#226: 10,167 samples counted for a 10,000-sample set).
targets: test_every_sample_once_per_epoch_and_replicas_in_step
"""

import math

import parallelism_conformance.impls.data_sampling as _bundled
from parallelism_conformance.impls import *


class DistributedSampler(_bundled.DistributedSampler):
    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        super().__init__(dataset, num_replicas, rank, shuffle, seed, False)
        self.num_samples = math.ceil(self.samples / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.drop_last = drop_last
        self._pad = True

    def __iter__(self):
        drop, self.drop_last = self.drop_last, False
        try:
            return super().__iter__()
        finally:
            self.drop_last = drop
