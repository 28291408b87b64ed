"""DistributedSampler shuffles with the process's global random generator, not one seeded by seed + epoch: each rank draws its own order, so replicas overlap and miss samples, and ranks of one replica disagree (Megatron-LM#206: the data loader used the RNG on tensor-parallel rank 0 only).
targets: test_every_sample_once_per_epoch_and_replicas_in_step
"""

import torch

import parallelism_conformance.impls.data_sampling as _bundled
from parallelism_conformance.impls import *


class DistributedSampler(_bundled.DistributedSampler):
    def __iter__(self):
        order = torch.randperm(self.samples).tolist() if self.shuffle else list(range(self.samples))
        if self.drop_last:
            order = order[: self.total_size]
        else:
            order = (order * -(-self.total_size // len(order)))[: self.total_size]
        return iter(order[self.rank : self.total_size : self.num_replicas])
