"""What distributed sampling must give the data-parallel ranks over one epoch (torch's
``DistributedSampler`` rules, which CONTRACT.md adopts): with N samples and n replicas, every
replica yields the same number of indices, ceil(N / n), padding the epoch with repeats so that
every sample is seen at least once (N + padding = n ceil(N / n) indices in all), or with
``drop_last`` floor(N / n), leaving N mod n samples unseen and none seen twice. Equal lengths are
what keeps data-parallel ranks in step: a replica with one batch more waits in its all-reduce for
ranks that have finished.

Never imports torch.distributed.
"""

from __future__ import annotations

import math
from collections import Counter


def epoch_length(samples: int, replicas: int, drop_last: bool) -> int:
    """Indices each replica yields in one epoch."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    return samples // replicas if drop_last else math.ceil(samples / replicas)


def coverage_problems(per_replica: list[list[int]], samples: int, drop_last: bool) -> list[str]:
    """What is wrong with one epoch's indices, ``per_replica[r]`` the indices replica r yielded:
    an index outside [0, samples), replicas of unequal length or of another length than
    ``epoch_length``, a sample never seen (without drop_last), a sample seen twice (with drop_last),
    or more repeats than the padding. Empty when the epoch is right."""
    n = len(per_replica)
    want = epoch_length(samples, n, drop_last)
    problems = []
    lengths = [len(indices) for indices in per_replica]
    if any(length != want for length in lengths):
        problems.append(f"the replicas yield {lengths} indices; each must yield {want} ({'floor' if drop_last else 'ceil'}({samples} / {n}))")
    flat = [i for indices in per_replica for i in indices]
    outside = sorted({i for i in flat if not (isinstance(i, int) and 0 <= i < samples)}, key=repr)
    if outside:
        problems.append(f"indices outside [0, {samples}): {outside[:5]}")
    counts = Counter(flat)
    if drop_last:
        twice = sorted(i for i, c in counts.items() if c > 1)
        if twice:
            problems.append(f"with drop_last no sample is seen twice; seen more than once: {twice[:5]}")
    else:
        unseen = sorted(set(range(samples)) - set(counts))
        if unseen:
            problems.append(f"samples never seen in the epoch: {unseen[:5]}{' ...' if len(unseen) > 5 else ''} ({len(unseen)} of {samples})")
        repeats = len(flat) - len(counts)
        padding = n * want - samples
        if repeats > padding:
            problems.append(f"{repeats} repeated indices where the padding is {padding} ({n} x {want} - {samples})")
    return problems


def resume_problems(before: list[list[int]], after: list[list[int]], samples: int, drop_last: bool) -> list[str]:
    """What is wrong with one epoch run in two parts: ``before[r]``, what replica r of the first
    run yielded before it stopped (each the same number k, so the world consumed c = k n indices),
    and ``after[r']``, what replica r' of the resumed run (any number of replicas n', built with
    consumed_samples=c) yielded for the rest of the epoch. The rest, N - c samples, is an epoch of
    its own for n' replicas: each yields ceil((N - c) / n') (floor with drop_last); over both parts
    every sample is seen (without drop_last), none twice but for the resumed part's padding, and
    with drop_last none twice at all. Empty when right."""
    consumed = sum(len(indices) for indices in before)
    problems = []
    seen_before = Counter(i for indices in before for i in indices)
    if any(c > 1 for c in seen_before.values()):
        problems.append(
            f"the first run's replicas yielded a sample twice before it stopped: {sorted(i for i, c in seen_before.items() if c > 1)[:5]}"
        )
    n = len(after)
    want = epoch_length(samples - consumed, n, drop_last)
    lengths = [len(indices) for indices in after]
    if any(length != want for length in lengths):
        problems.append(
            f"the resumed replicas yield {lengths} indices; after {consumed} of {samples} consumed each of "
            f"{n} must yield {want} ({'floor' if drop_last else 'ceil'}({samples - consumed} / {n}))"
        )
    counts = seen_before + Counter(i for indices in after for i in indices)
    outside = sorted({i for i in counts if not (isinstance(i, int) and 0 <= i < samples)}, key=repr)
    if outside:
        problems.append(f"indices outside [0, {samples}): {outside[:5]}")
    twice = sorted(i for i, c in counts.items() if c > 1)
    if drop_last and twice:
        problems.append(f"with drop_last no sample is seen twice in the epoch; seen more than once: {twice[:5]}")
    if not drop_last:
        unseen = sorted(set(range(samples)) - set(counts))
        if unseen:
            problems.append(
                f"samples never seen in the epoch: {unseen[:5]}{' ...' if len(unseen) > 5 else ''} "
                f"({len(unseen)} of {samples}): the resumed run skipped what the first had not consumed"
            )
        repeats = sum(c - 1 for c in counts.values() if c > 1)
        padding = n * want - (samples - consumed)
        if repeats > padding:
            problems.append(
                f"{repeats} repeated indices where the resumed part's padding is {padding}: samples the "
                f"first run consumed were seen again ({twice[:5]})"
            )
    return problems
