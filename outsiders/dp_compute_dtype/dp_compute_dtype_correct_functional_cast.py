"""Correct: data parallelism whose forward runs the model through functional_call on differentiable low-precision casts of its float32 masters, with float32 bucketed gradient averaging.

verdict: pass
capability: dp_compute_dtype

Written from the contract alone. Construction broadcasts rank 0's parameters (frozen ones too) and
buffers in place, then cuts the trainable parameters, deduplicated (a tied weight is one parameter)
and in reverse registration order, into buckets of at most ``bucket_size_mb`` MiB (a bucket may
exceed the cap only by the parameter that closed it; a dtype or device change also closes one).
With ``compute_dtype=d`` the wrapped module is never touched: each forward builds ``p.to(d)`` for
every floating parameter, which is differentiable, and runs the module through
``torch.func.functional_call`` on those copies (floating inputs are cast to d as DDP's
``mixed_precision`` does; buffers are the module's own, uncast). Backward therefore computes in d,
and autograd's cast-back turns each gradient into the master's dtype and accumulates it into the
master's ``.grad``, so accumulation and ``zero_grad(set_to_none=False)`` work as in one process,
while the parameters and the optimizer state stay float32. A post-accumulate-grad hook on every
master counts a bucket's parameters; once all have fired, that bucket and every ready bucket before
it (in a fixed order, so every rank issues the same collectives) is flattened and all-reduced
asynchronously in the parameters' dtype while backward goes on. ``finish_gradient_synchronization``
launches whatever is left (only parameters whose ``.grad`` exists, so unused ones keep None),
waits, divides the sums by the world size and copies them back into ``.grad``. Without a bucket
size everything is reduced there, in one flat buffer per dtype; the reduction is elementwise, so
every bucket setting gives the same numbers. The whole accumulated ``.grad`` is averaged after every
backward, which leaves already-averaged micro-batches unchanged.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

_COMPUTE_DTYPES = (torch.float16, torch.bfloat16)


def _cast_floating(obj, dtype):
    """Cast every floating tensor inside ``obj`` (nested tuples, lists, dicts) to ``dtype``."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_cast_floating(x, dtype) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floating(x, dtype) for x in obj)
    if isinstance(obj, dict):
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    return obj


def _broadcast_in_place(tensor):
    with torch.no_grad():
        if tensor.is_contiguous():
            dist.broadcast(tensor.data, src=0)
        else:
            tmp = tensor.detach().contiguous()
            dist.broadcast(tmp, src=0)
            tensor.data.copy_(tmp)


class DataParallel(nn.Module):
    def __init__(self, module, bucket_size_mb=None, compute_dtype=None):
        super().__init__()
        if compute_dtype is not None and compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be float16 or bfloat16, not {compute_dtype}")
        self.module = module
        self.compute_dtype = compute_dtype
        self.world_size = dist.get_world_size()

        # Every rank starts from rank 0's state: all parameters (frozen too) and buffers.
        for p in module.parameters():
            _broadcast_in_place(p)
        for b in module.buffers():
            _broadcast_in_place(b)

        trainable = [p for p in module.parameters() if p.requires_grad]
        self._overlap = bucket_size_mb is not None
        if self._overlap:
            self._buckets = self._make_buckets(list(reversed(trainable)), float(bucket_size_mb) * 2**20)
        else:
            self._buckets = self._make_buckets(trainable, None)
        self._bucket_index = {}
        for i, bucket in enumerate(self._buckets):
            for p in bucket:
                self._bucket_index[p] = i
        self._reset_round()
        if self._overlap:
            for p in trainable:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @staticmethod
    def _make_buckets(params, cap_bytes):
        buckets, current, size = [], [], 0
        for p in params:
            if current and (p.dtype != current[0].dtype or p.device != current[0].device):
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if cap_bytes is not None and size >= cap_bytes:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
        return buckets

    def _reset_round(self):
        self._fired = [set() for _ in self._buckets]
        self._next_bucket = 0
        self._in_flight = []

    # ---------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        d = self.compute_dtype
        if d is None:
            return self.module(*args, **kwargs)
        cast, by_id = {}, {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) not in by_id:
                # p.to(d) is differentiable: backward casts the gradient back to p's dtype and
                # accumulates it into p.grad; the module's own parameters are never modified.
                by_id[id(p)] = p.to(d) if p.is_floating_point() else p
            cast[name] = by_id[id(p)]
        args = _cast_floating(args, d)
        kwargs = _cast_floating(kwargs, d)
        return functional_call(self.module, cast, args, kwargs)

    # ------------------------------------------------------- communication
    def _on_grad_ready(self, param):
        i = self._bucket_index[param]
        self._fired[i].add(param)
        # Launch in bucket order only, so every rank issues the same collectives in the same order.
        while (self._next_bucket < len(self._buckets)
               and len(self._fired[self._next_bucket]) == len(self._buckets[self._next_bucket])):
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, i):
        params = [p for p in self._buckets[i] if p.grad is not None]
        if not params:
            return
        flat = torch.cat([p.grad.detach().reshape(-1) for p in params])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
        self._in_flight.append((work, flat, params))

    def finish_gradient_synchronization(self):
        while self._next_bucket < len(self._buckets):
            self._launch(self._next_bucket)
            self._next_bucket += 1
        with torch.no_grad():
            for work, flat, params in self._in_flight:
                work.wait()
                flat.div_(self.world_size)
                offset = 0
                for p in params:
                    n = p.grad.numel()
                    p.grad.copy_(flat[offset:offset + n].view(p.grad.shape))
                    offset += n
        self._reset_round()
