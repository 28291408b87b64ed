"""DataParallel built on torch.nn.parallel.DistributedDataParallel.

DDP averages gradients during backward (bucketed all-reduces started from autograd hooks), so
``finish_gradient_synchronization`` has nothing left to do. ``find_unused_parameters=True`` lets a
step leave some parameters without a gradient (DDP then keeps .grad None for a parameter no rank
used, as single-process training does); ``broadcast_buffers=True`` sends rank 0's buffers at every
forward, and DDP's constructor broadcasts rank 0's parameters and buffers.
"""
from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel


class _DistributedDataParallel(DistributedDataParallel):
    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: DDP has averaged every gradient by the end of backward."""


def DataParallel(module, bucket_size_mb=None):
    """DDP over the default group; buckets of ``bucket_size_mb`` MiB, or DDP's default (25)."""
    options = {} if bucket_size_mb is None else {"bucket_cap_mb": bucket_size_mb}
    return _DistributedDataParallel(module, broadcast_buffers=True, find_unused_parameters=True, **options)
