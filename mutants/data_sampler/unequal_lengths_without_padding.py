"""DistributedSampler neither pads nor drops: replica r takes every n-th index of the epoch's order from r, so when n does not divide the dataset some replicas have one index more (their extra batch waits in an all-reduce the others never join).
targets: test_every_sample_once_per_epoch_and_replicas_in_step
"""

import torch

import parallelism_conformance.impls.data_sampling as _bundled
from parallelism_conformance.impls import *


class DistributedSampler(_bundled.DistributedSampler):
    def _order(self):
        if not self.shuffle:
            return list(range(self.samples))
        return torch.randperm(self.samples, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def __iter__(self):
        return iter(self._order()[self.rank :: self.num_replicas])

    def __len__(self):
        return len(range(self.rank, self.samples, self.num_replicas))
