"""Rank program for distributed sampling (CONTRACT.md, "Distributed sampling"): build the
implementation's ``DistributedSampler`` over a dataset of ``samples`` items as this rank's
data-parallel replica, with the global random state set to something of this rank's own (an
implementation that draws its order from it disagrees with the other replicas), and report the
indices of each epoch asked for, its ``len()`` at that epoch, and the first epoch's indices again
from a second sampler built alike (the same seed and epoch must give the same order)."""
from __future__ import annotations

import torch

from harness.rank.context import RankContext, require


class _Dataset:
    def __init__(self, samples: int):
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> int:
        return index


def epochs(ctx: RankContext, impl, samples: int, replicas: int, replica: int, shuffle: bool, seed: int,
           drop_last: bool, epochs: list[int], group=None) -> dict:
    Sampler = require(impl, "DistributedSampler")
    torch.manual_seed(7919 * (ctx.rank + 1))  # a global random state of this rank's own

    def build():
        return Sampler(_Dataset(samples), num_replicas=replicas, rank=replica, shuffle=shuffle, seed=seed,
                       drop_last=drop_last)

    sampler, result = build(), {"epochs": [], "lengths": []}
    for epoch in epochs:
        sampler.set_epoch(epoch)
        result["lengths"].append(len(sampler))
        result["epochs"].append([int(i) for i in sampler])
    again = build()
    again.set_epoch(epochs[0])
    result["again"] = [int(i) for i in again]
    return result
