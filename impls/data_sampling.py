"""Distributed sampling for data parallelism, under torch's name and signature:
``DistributedSampler(dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False)``
with ``set_epoch(epoch)``. Each epoch's order is a permutation drawn from a private generator
seeded with seed + epoch (every replica draws the same one, whatever the global random state),
padded with its own first indices to a multiple of the replicas, or cut to one with drop_last;
replica r takes every n-th index from r, so the replicas' indices are disjoint but for the
padding, and of equal length.

``consumed_samples=c`` (capability sampler_resume): the run resumes mid-epoch after the whole
data-parallel world consumed c indices of it, at whatever number of replicas it had: the epoch's
remaining order is the permutation from position c on, padded or cut for this number of replicas
and dealt out the same way. A count over the world, not a replica's own position, so a run can
resume at another data-parallel size and still see every sample once.

Never imports reference/.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class DistributedSampler:
    def __init__(
        self,
        dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        consumed_samples: int = 0,
    ):
        self.num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        self.rank = dist.get_rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in [0, {self.num_replicas})")
        self.samples, self.shuffle, self.seed, self.drop_last = len(dataset), shuffle, seed, drop_last
        if not 0 <= consumed_samples <= self.samples:
            raise ValueError(f"consumed_samples = {consumed_samples} is not in [0, {self.samples}] (the dataset's size)")
        self.consumed = consumed_samples
        self.epoch = 0
        self._resumed_epoch = None  # the epoch consumed_samples belongs to: the first one set
        self._size()

    def _size(self) -> None:
        remaining = self.samples - self.consumed
        if self.drop_last:
            self.num_samples = remaining // self.num_replicas
        else:
            self.num_samples = math.ceil(remaining / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        if self._resumed_epoch is None:
            self._resumed_epoch = epoch
        elif epoch != self._resumed_epoch and self.consumed:  # a later epoch starts from its beginning
            self.consumed = 0
            self._size()
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.samples, generator=generator).tolist()
        else:
            order = list(range(self.samples))
        order = order[self.consumed :]
        if self.drop_last:
            order = order[: self.total_size]
        elif order:
            order = (order * math.ceil(self.total_size / len(order)))[: self.total_size]
        return iter(order[self.rank : self.total_size : self.num_replicas])
