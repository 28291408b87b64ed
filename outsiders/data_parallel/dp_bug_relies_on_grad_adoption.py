"""Gradient hooks hand autograd a view of the flat bucket and rely on it being adopted as ``.grad``, which only happens when ``.grad`` is None.

verdict: fail
capability: data_parallel

A zero-copy take on bucketed DDP (the idea behind DDP's ``gradient_as_bucket_view``): each
parameter's gradient hook copies the incoming gradient into its slot of a flat per-bucket buffer
and returns that slot, so that autograd stores the slot itself as ``.grad``; the bucket's async
all-reduce then works in place on the very memory ``.grad`` points to, and
``finish_gradient_synchronization`` only waits and divides. In the common test (one backward per
step, ``zero_grad()`` with its default ``set_to_none=True``) autograd does adopt the returned
tensor and everything matches. But once ``.grad`` already exists -- ``zero_grad(set_to_none=False)``
or a second micro-batch of gradient accumulation -- autograd adds into the existing ``.grad``
instead of adopting the slot, so the reduced buffer and ``.grad`` stop being related. PyTorch's own
docs warn about exactly this interplay between bucket views and ``zero_grad``.
"""
import torch
import torch.distributed as dist
from torch import nn

_MIB = 1024 * 1024


def _broadcast_from_rank0(tensors):
    with torch.no_grad():
        for t in tensors:
            if t.is_contiguous():
                dist.broadcast(t.data, src=0)
            else:
                tmp = t.data.contiguous()
                dist.broadcast(tmp, src=0)
                t.data.copy_(tmp)


class _Bucket:
    def __init__(self, params):
        self.params = params
        self.slot = {}
        total = 0
        for p in params:
            self.slot[p] = (total, p.numel())
            total += p.numel()
        self.flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.ready = set()
        self.handle = None

    def view_of(self, p):
        off, n = self.slot[p]
        return self.flat[off:off + n].view_as(p)

    def launch(self):
        self.handle = dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, async_op=True)


class _DataParallel(nn.Module):
    def __init__(self, module, bucket_size_mb=None):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        _broadcast_from_rank0(list(module.parameters()) + list(module.buffers()))
        self._trainable = [p for p in module.parameters() if p.requires_grad]
        cap = float("inf") if bucket_size_mb is None else bucket_size_mb * _MIB
        self._buckets = []
        self._bucket_of = {}
        current, nbytes = [], 0
        for p in reversed(self._trainable):
            if current and (p.dtype != current[0].dtype or p.device != current[0].device):
                self._buckets.append(_Bucket(current))
                current, nbytes = [], 0
            current.append(p)
            nbytes += p.numel() * p.element_size()
            if nbytes >= cap:
                self._buckets.append(_Bucket(current))
                current, nbytes = [], 0
        if current:
            self._buckets.append(_Bucket(current))
        for b in self._buckets:
            for p in b.params:
                self._bucket_of[p] = b
                p.register_hook(self._make_hook(p))

    def _make_hook(self, p):
        def hook(grad):
            b = self._bucket_of[p]
            view = b.view_of(p)
            with torch.no_grad():
                view.copy_(grad)
            b.ready.add(p)
            if len(b.ready) == len(b.params) and b.handle is None:
                b.launch()
            return view
        return hook

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for b in self._buckets:
            if b.handle is None and any(p.grad is not None for p in b.params):
                with torch.no_grad():
                    for p in b.params:
                        if p not in b.ready:
                            if p.grad is None:
                                b.view_of(p).zero_()
                            else:
                                b.view_of(p).copy_(p.grad)
                b.launch()
        for b in self._buckets:
            if b.handle is not None:
                b.handle.wait()
                with torch.no_grad():
                    b.flat.div_(self.world_size)
                b.handle = None
            b.ready.clear()
        _broadcast_from_rank0(list(self.module.buffers()))


def DataParallel(module, bucket_size_mb=None):
    return _DataParallel(module, bucket_size_mb)


__all__ = ["DataParallel"]
