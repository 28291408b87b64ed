"""Correct: post-accumulate-grad hooks fill reverse-order flat buckets whose async all-reduces are waited in finish.

verdict: pass
capability: data_parallel

Written from the contract alone, in the style of PyTorch DDP's reducer: parameters are bucketed in
reverse registration order (the order backward produces gradients), one dtype per bucket, each
bucket closed once it reaches the cap (so it exceeds it only by its closing parameter). A
``register_post_accumulate_grad_hook`` marks a parameter ready once autograd has finished adding
into ``.grad``; when every parameter of a bucket is ready, the bucket copies the accumulated
``.grad`` tensors into its flat buffer and starts an asynchronous all-reduce. Buckets that a step
left partially filled (an unused parameter) are reduced in ``finish_gradient_synchronization``,
which then waits for everything, divides by the world size and copies into ``.grad`` in place.
With ``bucket_size_mb=None`` it is naive data parallelism: everything is reduced in finish.
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
        if bucket_size_mb is not None:
            self._build_buckets(bucket_size_mb * _MIB)

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

    def _naive_sync(self):
        by_dtype = {}
        for p in self._trainable:
            if p.grad is not None:
                by_dtype.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), params in by_dtype.items():
            with torch.no_grad():
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                flat.div_(self.world_size)
                off = 0
                for p in params:
                    n = p.numel()
                    p.grad.copy_(flat[off:off + n].view_as(p.grad))
                    off += n

    def finish_gradient_synchronization(self):
        if self.bucket_size_mb is None:
            self._naive_sync()
        else:
            for b in self._buckets:
                if b.handle is None and any(p.grad is not None for p in b.params):
                    b.launch()
            for b in self._buckets:
                if b.handle is not None:
                    b.finish(self.world_size)
                else:
                    b.ready.clear()
        _broadcast_from_rank0(list(self.module.buffers()))


def DataParallel(module, bucket_size_mb=None):
    return _DataParallel(module, bucket_size_mb)


__all__ = ["DataParallel"]
