"""Rank program for distributed sampling (CONTRACT.md, "Distributed sampling"): build the
implementation's ``DistributedSampler`` over a dataset of ``samples`` items as this rank's
data-parallel replica, with the global random state set to something of this rank's own (an
implementation that draws its order from it disagrees with the other replicas), and report the
indices of each epoch asked for, its ``len()`` at that epoch, and the first epoch's indices again
from a second sampler built alike (the same seed and epoch must give the same order)."""

from __future__ import annotations

import itertools

import torch

from parallelism_conformance.harness.rank.context import RankContext, require


class _Dataset:
    def __init__(self, samples: int):
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> int:
        return index


def epochs(
    ctx: RankContext, impl, samples: int, replicas: int, replica: int, shuffle: bool, seed: int, drop_last: bool, epochs: list[int], group=None
) -> dict:
    Sampler = require(impl, "DistributedSampler")
    torch.manual_seed(7919 * (ctx.rank + 1))  # a global random state of this rank's own

    def build():
        return Sampler(_Dataset(samples), num_replicas=replicas, rank=replica, shuffle=shuffle, seed=seed, drop_last=drop_last)

    sampler, result = build(), {"epochs": [], "lengths": []}
    for epoch in epochs:
        sampler.set_epoch(epoch)
        result["lengths"].append(len(sampler))
        result["epochs"].append([int(i) for i in sampler])
    again = build()
    again.set_epoch(epochs[0])
    result["again"] = [int(i) for i in again]
    return result


def resume(
    ctx: RankContext,
    impl,
    samples: int,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    epoch: int,
    first_replicas: int,
    steps: int,
    second_replicas: int,
    group=None,
) -> dict:
    """One epoch in two runs, every replica's sampler built here (the sampler takes its replica and
    their number as arguments; each is built under a global random state of its own): the first
    run's n replicas yield ``steps`` indices each and stop; the resumed run's n' replicas are built
    with ``consumed_samples`` = steps n, set to the same epoch, and yield the rest. Also reported:
    what the resumed replica 0 yields once set to the next epoch, against a fresh sampler's (the
    count belongs to the resumed epoch only)."""
    Sampler = require(impl, "DistributedSampler")

    def build(replicas, replica, **options):
        torch.manual_seed(7919 * (replica + 1) + 104729 * replicas)
        sampler = Sampler(_Dataset(samples), num_replicas=replicas, rank=replica, shuffle=shuffle, seed=seed, drop_last=drop_last, **options)
        sampler.set_epoch(epoch)
        return sampler

    before = [[int(i) for i in itertools.islice(build(first_replicas, r), steps)] for r in range(first_replicas)]
    consumed = steps * first_replicas
    resumed = [build(second_replicas, r, consumed_samples=consumed) for r in range(second_replicas)]
    after = [[int(i) for i in sampler] for sampler in resumed]
    lengths = [len(sampler) for sampler in resumed]
    resumed[0].set_epoch(epoch + 1)
    fresh = build(second_replicas, 0)
    fresh.set_epoch(epoch + 1)
    return {
        "before": before,
        "after": after,
        "lengths": lengths,
        "next_epoch": [int(i) for i in resumed[0]],
        "fresh_next_epoch": [int(i) for i in fresh],
    }
