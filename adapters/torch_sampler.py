"""torch's own ``torch.utils.data.DistributedSampler`` behind the suite's sampling contract: the
contract is its signature and its rules (equal replica lengths, padding by repeats, drop_last).

torch's sampler cannot resume mid-epoch (capability sampler_resume): it has no count of what was
consumed, and skipping the first indices of a replica's own stream is right only at the same number
of replicas. Asked for ``consumed_samples``, the adapter says so (NotImplementedError: the test is
skipped with the reason for torch, never passed by a stand-in)."""

from __future__ import annotations

from torch.utils.data import DistributedSampler as _TorchSampler


class DistributedSampler(_TorchSampler):
    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False, consumed_samples=None):
        if consumed_samples is not None:
            raise NotImplementedError(
                "torch.utils.data.DistributedSampler cannot resume mid-epoch: it takes no count of "
                "the samples already consumed (consumed_samples)"
            )
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
