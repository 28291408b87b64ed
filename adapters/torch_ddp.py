"""DataParallel built on torch.nn.parallel.DistributedDataParallel.

DDP averages gradients during backward (bucketed all-reduces started from autograd hooks), so
``finish_gradient_synchronization`` has nothing left to do. ``find_unused_parameters=True`` lets a
step leave some parameters without a gradient (DDP then keeps .grad None for a parameter no rank
used, as single-process training does); ``broadcast_buffers=True`` sends rank 0's buffers at every
forward, and DDP's constructor broadcasts rank 0's parameters and buffers.

``gradient_divide_factor`` f: a communication hook (``register_comm_hook``, the documented way to
change DDP's reduction; DDP leaves the division to a hook it is given) sums each bucket over ranks
and divides by f. DDP's reducer puts each parameter's accumulated .grad in the bucket, which
averaging may reduce whole but a sum may not (under gradient accumulation the part synchronized by
earlier backwards would be counted n times), so the hook reduces only what the latest backward
added: the bucket less what the bucket's .grads held when forward ran.

``compute_dtype`` d: DDP's own mixed precision (``mixed_precision=_MixedPrecision(param_dtype=d,
reduce_dtype=d, buffer_dtype=d)``, the constructor's argument; its class is private in torch 2.13):
forward and backward on parameters cast to d, gradients reduced in d and kept in the masters' dtype.
It cannot run on CPU ranks: its forward pre-hook copies the parameters to d on a side stream and
records an event (torch 2.13: "cpu backend doesn't support events"), so there it is refused, on
every rank, before anything is built.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class _DistributedDataParallel(DistributedDataParallel):
    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: DDP has averaged every gradient by the end of backward."""


class _SummingDistributedDataParallel(_DistributedDataParallel):
    """DDP whose hook sums what the latest backward added to each bucket (the module docstring)."""

    def forward(self, *args, **kwargs):
        self._held = {id(p): None if p.grad is None else p.grad.detach().clone() for p in self.module.parameters()}
        return super().forward(*args, **kwargs)

    def held_before(self, bucket) -> torch.Tensor:
        held = getattr(self, "_held", {})
        return torch.cat([(held.get(id(p)) if held.get(id(p)) is not None else torch.zeros_like(p)).reshape(-1) for p in bucket.parameters()])


def _sum_divided_by_factor(wrapped: _SummingDistributedDataParallel, bucket):
    """A DDP communication hook: what .grad held before, plus the sum over ranks of what this
    backward added, divided by the wrapper's ``divide_factor``."""
    before = wrapped.held_before(bucket)
    added = bucket.buffer() - before.to(bucket.buffer().dtype)
    future = dist.all_reduce(added, async_op=True).get_future()
    return future.then(lambda done: before + done.value()[0] / wrapped.divide_factor)


def DataParallel(module, bucket_size_mb=None, gradient_divide_factor=None, compute_dtype=None):
    """DDP over the default group; buckets of ``bucket_size_mb`` MiB, or DDP's default (25)."""
    options = {} if bucket_size_mb is None else {"bucket_cap_mb": bucket_size_mb}
    if compute_dtype is not None:
        from torch.nn.parallel.distributed import _MixedPrecision

        if next(module.parameters()).device.type == "cpu":
            raise NotImplementedError(
                "torch's DDP cannot run mixed_precision on CPU ranks: it records a stream event "
                "for its parameter casts, which the cpu backend does not support"
            )
        options["mixed_precision"] = _MixedPrecision(param_dtype=compute_dtype, reduce_dtype=compute_dtype, buffer_dtype=compute_dtype)
    kind = _DistributedDataParallel if gradient_divide_factor is None else _SummingDistributedDataParallel
    wrapped = kind(module, broadcast_buffers=True, find_unused_parameters=True, **options)
    if gradient_divide_factor is not None:
        wrapped.divide_factor = float(gradient_divide_factor)
        wrapped.register_comm_hook(wrapped, _sum_divided_by_factor)
    return wrapped
