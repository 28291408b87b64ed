"""Distributed sampling for data parallelism, under torch's name and signature:
``DistributedSampler(dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False)``
with ``set_epoch(epoch)``. Each epoch's order is a permutation drawn from a private generator
seeded with seed + epoch (every replica draws the same one, whatever the global random state),
padded with its own first indices to a multiple of the replicas, or cut to one with drop_last;
replica r takes every n-th index from r, so the replicas' indices are disjoint but for the
padding, and of equal length.

Never imports reference/.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


class DistributedSampler:
    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        self.num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        self.rank = dist.get_rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in [0, {self.num_replicas})")
        self.samples, self.shuffle, self.seed, self.drop_last = len(dataset), shuffle, seed, drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = self.samples // self.num_replicas
        else:
            self.num_samples = math.ceil(self.samples / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.samples, generator=generator).tolist()
        else:
            order = list(range(self.samples))
        if self.drop_last:
            order = order[:self.total_size]
        elif order:
            order = (order * math.ceil(self.total_size / len(order)))[:self.total_size]
        return iter(order[self.rank:self.total_size:self.num_replicas])
