"""A bucket left partially filled because one of its parameters got no gradient this step is never all-reduced.

verdict: fail
capability: data_parallel

Hook-driven bucketing (the CS336 assignment 2 design) starts each bucket's all-reduce from the
gradient hook that completes it, and ``finish_gradient_synchronization`` then just waits on the
handles it has collected. That is right as long as every parameter gets a gradient in every
backward; when a parameter goes unused (a branch skipped this step, DDP's
``find_unused_parameters`` situation), its bucket never becomes "full", no handle is ever created
for it, and the other parameters of that bucket keep their local, unaveraged gradients. It is the
classic "expected autograd hook to fire / bucket never ready" failure seen in DDP issues and
forum threads; with ``bucket_size_mb=None`` this implementation uses one unbounded bucket, so the
whole model is affected.
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
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.flat = None
        self.ready = set()
        self.handle = None
        self.with_grad = []

    def nbytes(self):
        return self.numel * self.params[0].element_size()

    def launch(self):
        if self.flat is None:
            self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.with_grad = []
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                piece = self.flat[off:off + p.numel()]
                if p.grad is None:
                    piece.zero_()
                else:
                    piece.copy_(p.grad.reshape(-1))
                    self.with_grad.append((p, off))
        self.handle = dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, async_op=True)

    def finish(self, world):
        self.handle.wait()
        with torch.no_grad():
            self.flat.div_(world)
            for p, off in self.with_grad:
                p.grad.copy_(self.flat[off:off + p.numel()].view_as(p.grad))
        self.handle = None
        self.with_grad = []
        self.ready.clear()


class _DataParallel(nn.Module):
    def __init__(self, module, bucket_size_mb=None):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        _broadcast_from_rank0(list(module.parameters()) + list(module.buffers()))
        self._trainable = [p for p in module.parameters() if p.requires_grad]
        self.bucket_size_mb = bucket_size_mb
        self._buckets = []
        self._bucket_of = {}
        self._hooks = []
        cap = float("inf") if bucket_size_mb is None else bucket_size_mb * _MIB
        self._build_buckets(cap)

    def _build_buckets(self, cap_bytes):
        current, nbytes = [], 0
        for p in reversed(self._trainable):
            if current and (p.dtype != current[0].dtype or p.device != current[0].device):
                self._buckets.append(_Bucket(current))
                current, nbytes = [], 0
            current.append(p)
            nbytes += p.numel() * p.element_size()
            if nbytes >= cap_bytes:
                self._buckets.append(_Bucket(current))
                current, nbytes = [], 0
        if current:
            self._buckets.append(_Bucket(current))
        for b in self._buckets:
            for p in b.params:
                self._bucket_of[p] = b
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _on_grad_ready(self, p):
        b = self._bucket_of[p]
        if b.handle is not None:
            return
        b.ready.add(p)
        if len(b.ready) == len(b.params):
            b.launch()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for b in self._buckets:
            if b.handle is not None:
                b.finish(self.world_size)
            else:
                b.ready.clear()
        _broadcast_from_rank0(list(self.module.buffers()))


def DataParallel(module, bucket_size_mb=None):
    return _DataParallel(module, bucket_size_mb)


__all__ = ["DataParallel"]
