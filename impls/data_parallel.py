"""Data parallelism: every rank keeps the whole model, takes its slice of the batch, and averages
gradients across ranks after backward, so ranks that start identical stay identical.

Every variant wraps a module, broadcasts group rank 0's parameters (frozen ones too) and buffers
when it is built, and after ``loss.backward()`` and ``finish_gradient_synchronization()`` leaves in
each trainable parameter's .grad the mean over ranks, g = (1/n) sum_r g_r (all_reduce with AVG:
the ring's sum, divided once by n; every rank ends with bitwise the same result). With each rank's
loss the mean over its own B/n samples, g is the gradient of the global-batch mean loss.

* NaiveDataParallel: after backward, one all_reduce per parameter, in registration order.
* OverlappedDataParallel: a post-accumulate-grad hook on each parameter hands its gradient, the
  moment autograd has finished accumulating it, to a communication thread that runs the
  all_reduces one after another, in the order gradients became ready, while the main thread goes
  on with the rest of backward: communication of the last layers' gradients overlaps the
  computation of the earlier layers' ones. finish_gradient_synchronization waits for them.
* BucketedDataParallel: the same, but gradients are copied into flat buckets of at most
  bucket_size_mb MiB (parameters in reverse registration order, roughly the order backward produces
  them; a parameter larger than the bucket gets a bucket of its own), and a bucket's single
  all_reduce is handed to the communication thread as soon as all its gradients are in: fewer,
  larger messages (less per-message latency alpha) at the price of the copies.

Communication goes through :mod:`impls.collectives` (point-to-point based; synchronous, hence the
thread); torch.distributed is used for group bookkeeping only. The communication thread is the
only thread of this process that communicates between a backward and the finish that follows it,
and every rank submits the same reductions in the same order, so messages match.

Which parameters take part is decided per parameter, identically on every rank:
* a parameter shared by several modules (tied weights) is one parameter: one hook, one reduction;
* a frozen parameter (requires_grad=False) is broadcast at construction and never reduced;
* with ``gradient_divide_factor`` f the reduction is the sum divided by f, and a rank reduces only
  what the latest backward added to .grad (.grad less what it held when forward ran): under
  gradient accumulation the part already synchronized is the same on every rank, which an average
  leaves unchanged but a sum would count n times;
* with ``compute_dtype`` d the forward calls the module with its trainable floating parameters
  cast to d (``torch.func.functional_call``; the casts are in the graph, so backward runs in d and
  each cast's backward brings the gradient back to the master's dtype, where it is reduced): the
  masters, their .grad and the optimizer state keep the module's dtype;
* a parameter that got no gradient in a step (no forward used it) keeps .grad None, so torch's
  optimizers skip it, exactly as in single-process training. This assumes, like the contract, that
  the same parameters go unused on every rank (no data-dependent control flow); torch's DDP pays an
  extra all-reduce of a usage bitmap (find_unused_parameters) to lift that.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_reduce, broadcast

MIB = 1024 * 1024

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _communication_thread() -> ThreadPoolExecutor:
    """This process's single communication thread (FIFO: reductions run in submission order)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-parallel-comm")
        return _executor


def _reduce_(tensor: torch.Tensor, group, divide_factor: float | None) -> None:
    """tensor <- (1/n) sum over the group's ranks of tensor, in place; with ``divide_factor`` f,
    (1/f) sum instead (f = 1: the sum, for a loss already divided by the global token count)."""
    if divide_factor is None:
        all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
    else:
        all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor.div_(divide_factor)


class _DataParallelBase(nn.Module):
    """Holds the module, broadcasts group rank 0's state, forwards calls to the module."""

    def __init__(
        self, module: nn.Module, process_group=None, gradient_divide_factor: float | None = None, compute_dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.divide_factor = gradient_divide_factor
        self.compute_dtype = compute_dtype
        self._held: dict[int, torch.Tensor | None] = {}  # under a divide factor: each .grad when forward ran
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                broadcast(tensor.detach(), group=process_group, group_src=0)
        # one entry per parameter object (module.parameters() already drops tied duplicates)
        self._trainable = [p for p in module.parameters() if p.requires_grad]

    def forward(self, *args, **kwargs):
        if self.divide_factor is not None:
            self._held = {id(p): None if p.grad is None else p.grad.detach().clone() for p in self._trainable}
        if self.compute_dtype is None:
            return self.module(*args, **kwargs)
        cast = {name: p.to(self.compute_dtype) for name, p in self.module.named_parameters() if p.requires_grad and p.is_floating_point()}
        args = tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        return torch.func.functional_call(self.module, cast, args, kwargs)

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    def _contribution(self, param: nn.Parameter) -> torch.Tensor:
        """What this rank reduces for ``param``: .grad itself when averaging, else only what the
        latest backward added to it (the module docstring says why)."""
        if self.divide_factor is None:
            return param.grad
        held = self._held.get(id(param))
        return param.grad.detach().clone() if held is None else param.grad.detach() - held

    def _landed(self, param: nn.Parameter, reduced: torch.Tensor) -> torch.Tensor:
        """What .grad holds once ``reduced`` (the reduction of ``_contribution``) is back."""
        held = self._held.get(id(param)) if self.divide_factor is not None else None
        return reduced if held is None else held + reduced


class NaiveDataParallel(_DataParallelBase):
    """All-reduce (average) every gradient after backward, one parameter at a time."""

    def finish_gradient_synchronization(self) -> None:
        for param in self._trainable:
            if param.grad is not None:
                work = self._contribution(param)
                _reduce_(work, self.process_group, self.divide_factor)
                if work is not param.grad:
                    param.grad.copy_(self._landed(param, work))


class OverlappedDataParallel(_DataParallelBase):
    """Start each gradient's all-reduce from its post-accumulate-grad hook, on the communication
    thread, while backward continues; wait for all of them in finish_gradient_synchronization."""

    def __init__(
        self, module: nn.Module, process_group=None, gradient_divide_factor: float | None = None, compute_dtype: torch.dtype | None = None
    ):
        super().__init__(module, process_group, gradient_divide_factor, compute_dtype)
        self._pending: list[tuple[nn.Parameter, torch.Tensor, Future]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self._trainable]

    def _ready(self, param: nn.Parameter) -> None:
        work = self._contribution(param)
        self._pending.append((param, work, _communication_thread().submit(_reduce_, work, self.process_group, self.divide_factor)))

    def finish_gradient_synchronization(self) -> None:
        pending, self._pending = self._pending, []
        for param, work, future in pending:
            future.result()  # re-raises what the communication thread raised
            if work is not param.grad:
                param.grad.copy_(self._landed(param, work))


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.ready: set[int] = set()  # indices into params whose gradient is in flat
        self.future: Future | None = None

    def slot(self, index: int) -> torch.Tensor:
        p = self.params[index]
        return self.flat[self.offsets[index] : self.offsets[index] + p.numel()].view_as(p)


class BucketedDataParallel(_DataParallelBase):
    """Gradients packed into buckets of at most ``bucket_size_mb`` MiB, in reverse registration
    order; a bucket's all-reduce starts (on the communication thread) as soon as it is full."""

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float,
        process_group=None,
        gradient_divide_factor: float | None = None,
        compute_dtype: torch.dtype | None = None,
    ):
        super().__init__(module, process_group, gradient_divide_factor, compute_dtype)
        if bucket_size_mb is None or bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb!r}")
        self.bucket_bytes = int(bucket_size_mb * MIB)
        self._buckets = self._pack(list(reversed(self._trainable)))
        self._where = {}
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b, i)
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self._trainable]

    def _pack(self, params: list[nn.Parameter]) -> list[_Bucket]:
        """Greedy: fill a bucket until the next parameter would take it past the cap (or has another
        dtype or device); a parameter over the cap alone gets its own bucket."""
        groups, current, size = [], [], 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            fits = size + nbytes <= self.bucket_bytes
            same_kind = not current or (p.dtype, p.device) == (current[0].dtype, current[0].device)
            if current and not (fits and same_kind):
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            groups.append(current)
        return [_Bucket(g) for g in groups]

    def _ready(self, param: nn.Parameter) -> None:
        b, i = self._where[id(param)]
        bucket = self._buckets[b]
        bucket.slot(i).copy_(self._contribution(param))
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params):
            self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        bucket.future = _communication_thread().submit(_reduce_, bucket.flat, self.process_group, self.divide_factor)

    def finish_gradient_synchronization(self) -> None:
        # Buckets with a parameter that got no gradient this step were never full: reduce what they
        # hold now (missing slots are zero), in bucket order, the same on every rank.
        for bucket in self._buckets:
            if bucket.future is None and bucket.ready:
                self._start(bucket)
        for bucket in self._buckets:
            if bucket.future is not None:
                bucket.future.result()
                for i in bucket.ready:
                    bucket.params[i].grad.copy_(self._landed(bucket.params[i], bucket.slot(i)))
            bucket.flat.zero_()
            bucket.ready.clear()
            bucket.future = None


def DataParallel(
    module: nn.Module,
    bucket_size_mb: float | None = None,
    process_group=None,
    gradient_divide_factor: float | None = None,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """The contract's entry point: overlapped per-parameter all-reduces when ``bucket_size_mb`` is
    None, else buckets of at most ``bucket_size_mb`` MiB; gradients averaged over the group, or
    summed and divided by ``gradient_divide_factor`` when given; forward and backward in
    ``compute_dtype`` when given."""
    if bucket_size_mb is None:
        return OverlappedDataParallel(module, process_group, gradient_divide_factor, compute_dtype)
    return BucketedDataParallel(module, bucket_size_mb, process_group, gradient_divide_factor, compute_dtype)
