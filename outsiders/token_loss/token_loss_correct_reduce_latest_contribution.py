"""Correct: both wrappers reduce only what the latest backward added, summed over ranks and divided by the gradient divide factor (or the world size), and the token count is an integer all-reduce.

verdict: pass
capability: token_loss

Written from the contract alone. ``global_token_count`` all-reduces (SUM) the local count as one
int64 element, so every rank returns the same exact integer C. Both wrappers divide the rank-summed
gradient by ``gradient_divide_factor`` when it is given and by the group's size otherwise, and both
only ever reduce the gradient of the latest backward, then add it to what ``.grad`` already held:
averaging the accumulated ``.grad`` whole would be harmless, but summing it would count the earlier
micro-batches n times again. ``DataParallel`` broadcasts rank 0's parameters (frozen ones too) and
buffers at construction and its buffers again before every forward (as DDP does); a tensor hook on
every trainable parameter takes this backward's local gradient aside and lets autograd accumulate
zeros in its place, so ``.grad`` only ever holds synchronized values (bitwise the same on every
rank) and ``finish_gradient_synchronization`` all-reduces each taken-aside gradient once, in
registration order, and adds it in. A tied parameter is one tensor with one hook (reduced once), a
frozen one has no hook, an unused one never fires its hook and keeps ``.grad`` None. The reduction
is per parameter in ``finish_gradient_synchronization`` whatever ``bucket_size_mb`` says: the values
do not depend on bucketing, and one parameter per reduction never exceeds a bucket's cap.
``fully_shard`` replaces every parameter its module owns (and no earlier unit took) by a flat 1-D
shard of ``ceil(numel / n)`` elements, padded with zeros, so the optimizer built over
``module.parameters()`` steps this rank's pieces only. Before the module's forward it all-gathers
(one collective per dtype) into per-parameter full storages and hands the forward views of them in
place of the shards; the trainable views come out of one autograd Function whose backward runs once
every use of them is done, reduce-scatters (one collective per dtype) the padded gradients and
returns each rank's piece, which autograd adds into the shard's ``.grad``; an unused parameter's
gradient is None there and its ``.grad`` stays None. Non-root units free their full storages after
forward (``reshard_after_forward``) and gather them again from a hook on their outputs' gradients
before backward reaches them; every storage is freed again after backward. Buffers are not touched.
"""
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["global_token_count", "DataParallel", "fully_shard", "full_parameters"]


def _comm_device(group=None):
    """Where a small tensor must live for this group's backend (NCCL only takes CUDA tensors)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------------
# The global token count
# --------------------------------------------------------------------------------------------------

def global_token_count(local_count, group=None):
    """Sum of ``local_count`` over the group's ranks, the same int on every rank.

    The count travels as int64 (not float): it must be exactly C on every rank, whatever its size.
    """
    count = torch.tensor([int(local_count)], dtype=torch.int64, device=_comm_device(group))
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return int(count.item())


# --------------------------------------------------------------------------------------------------
# Data parallelism
# --------------------------------------------------------------------------------------------------

def _broadcast_inplace(tensor, src=0, group=None):
    """Overwrite ``tensor`` with rank ``src``'s value (parameters and buffers, under no_grad)."""
    with torch.no_grad():
        data = tensor.detach()
        if data.is_contiguous():
            dist.broadcast(data, src=src, group=group)
        else:
            tmp = data.contiguous()
            dist.broadcast(tmp, src=src, group=group)
            data.copy_(tmp)


class DataParallel(nn.Module):
    """Replicated data parallelism; gradients summed over ranks and divided by f (default: n)."""

    def __init__(self, module, bucket_size_mb=None, gradient_divide_factor=None):
        super().__init__()
        self.module = module
        # Bucketing only changes when the reductions run, never their values; this wrapper reduces
        # every parameter on its own in finish_gradient_synchronization, which is within any cap.
        self.bucket_size_mb = bucket_size_mb
        self.world_size = dist.get_world_size()
        # FSDP2's set_gradient_divide_factor: sum over ranks, divide by f; without it, the mean.
        if gradient_divide_factor is None:
            self._divisor = float(self.world_size)
        else:
            self._divisor = float(gradient_divide_factor)

        # Every rank starts from rank 0's parameters (frozen ones too) and buffers.
        for tensor in list(module.parameters()) + list(module.buffers()):
            _broadcast_inplace(tensor, src=0)

        # parameters() yields a tied parameter once, so it gets one hook and one reduction; a
        # frozen parameter gets none (it is never reduced and never changes).
        self._params = [p for p in module.parameters() if p.requires_grad]
        # This backward's local gradient of each parameter, not yet reduced (None: nothing new).
        self._pending = [None] * len(self._params)
        for index, param in enumerate(self._params):
            param.register_hook(self._make_take_aside_hook(index))

    def _make_take_aside_hook(self, index):
        def hook(grad):
            # Keep the local gradient out of .grad: .grad must only ever hold what has been
            # synchronized, so that finish_gradient_synchronization can reduce the new part alone
            # (a SUM over ranks of the whole accumulated .grad would re-add the earlier
            # micro-batches) and .grad stays bitwise identical across ranks. Autograd then
            # accumulates the zeros returned here: into the existing .grad (unchanged, which also
            # covers zero_grad(set_to_none=False)) or as a fresh zero .grad when it was None.
            previous = self._pending[index]
            if previous is None:
                self._pending[index] = grad.detach().clone(memory_format=torch.contiguous_format)
            else:  # two backwards without a synchronization in between: still the new part only
                self._pending[index] = previous + grad.detach()
            return torch.zeros_like(grad)
        return hook

    def forward(self, *args, **kwargs):
        # As DDP's broadcast_buffers: every rank runs the forward with rank 0's buffers.
        for buffer in self.module.buffers():
            _broadcast_inplace(buffer, src=0)
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        # Registration order, same on every rank; by the contract every rank used the same
        # parameters in this backward, so every rank skips the same ones.
        for index, param in enumerate(self._params):
            local = self._pending[index]
            if local is None:
                continue  # not used by the latest backward: .grad left as it was (None stays None)
            self._pending[index] = None
            dist.all_reduce(local, op=dist.ReduceOp.SUM)
            local.div_(self._divisor)
            # old .grad (already synchronized, equal on all ranks) + reduced new part.
            if param.grad is None:
                param.grad = local
            else:
                param.grad.add_(local)


# --------------------------------------------------------------------------------------------------
# Fully sharded data parallelism
# --------------------------------------------------------------------------------------------------

# Units whose pre-backward hook ran during the current backward: all freed by the final callback.
_touched_units = weakref.WeakSet()
_final_callback_queued = False


def _queue_final_callback():
    """Once per backward: free every storage gathered during it when the whole backward is over."""
    global _final_callback_queued
    if _final_callback_queued:
        return
    _final_callback_queued = True
    torch.autograd.Variable._execution_engine.queue_callback(_after_backward)


def _after_backward():
    global _final_callback_queued
    _final_callback_queued = False
    for unit in list(_touched_units):
        unit.reshard()
    _touched_units.clear()


class _ShardedParam:
    """One parameter of a unit: the shard the optimizer sees, and a storage to gather it into."""

    def __init__(self, param, uses, group, rank, world):
        self.group = group
        self.uses = uses                      # [(module, attribute name)]: several when tied
        self.shape = param.shape
        self.numel = param.numel()
        self.world = world
        self.chunk = max(1, math.ceil(self.numel / world))   # elements per rank, with padding
        padded = self.chunk * world
        with torch.no_grad():
            flat = torch.zeros(padded, dtype=param.dtype, device=param.device)
            flat[: self.numel] = param.detach().reshape(-1)
            piece = flat[rank * self.chunk:(rank + 1) * self.chunk].clone()
        self.shard = nn.Parameter(piece, requires_grad=param.requires_grad)
        self.shard._fs_sharded = self         # how full_parameters finds the full shape back
        # The gathered (unsharded) parameter lives here; its storage is freed (resized to 0 bytes)
        # whenever the unit is resharded, and the views saved by autograd see it come back when
        # it is gathered again.
        self.full = torch.empty(padded, dtype=param.dtype, device=param.device)
        self.full.untyped_storage().resize_(0)
        self.allocated = False

    def allocate(self):
        if not self.allocated:
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
            self.allocated = True

    def free(self):
        if self.allocated:
            self.full.untyped_storage().resize_(0)
            self.allocated = False

    def full_view(self):
        return self.full[: self.numel].view(self.shape)


def _by_dtype(items, key):
    groups = {}
    for item in items:
        groups.setdefault(key(item).dtype, []).append(item)
    return groups.values()


class _Unshard(torch.autograd.Function):
    """Shards -> full parameters; backward: reduce-scatter and return this rank's pieces.

    Autograd runs this backward once, after every use of the unit's trainable full parameters in
    this backward; a parameter no forward used comes with a None gradient and gets None back, so
    its shard's ``.grad`` stays None. What is returned is added into ``.grad`` by autograd, which
    is gradient accumulation with only the latest backward's gradient reduced.
    """

    @staticmethod
    def forward(ctx, unit, *shards):
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        return tuple(p.full_view() for p in unit.trainable)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + tuple(ctx.unit.reduce_scatter(grads))


class _FullyShardedUnit:
    def __init__(self, module, group, reshard_after_forward, gradient_divide_factor):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.reshard_after_forward = reshard_after_forward
        # Summed over ranks then divided by f, or the mean over ranks without f.
        self.divisor = float(self.world if gradient_divide_factor is None else gradient_divide_factor)
        self.is_root = True                   # until fully_shard is applied to an ancestor
        self.gathered = False

        # Every parameter of the subtree that no unit below took already; a tied parameter is
        # one entry with all of its (module, name) uses, so it is sharded, gathered and reduced
        # once.
        uses = {}
        originals = {}
        for sub in module.modules():
            for name, param in sub._parameters.items():
                if param is None or hasattr(param, "_fs_sharded"):
                    continue
                uses.setdefault(id(param), []).append((sub, name))
                originals[id(param)] = param
        self.params = [_ShardedParam(originals[k], uses[k], group, self.rank, self.world) for k in uses]
        self.trainable = [p for p in self.params if p.shard.requires_grad]
        self.frozen = [p for p in self.params if not p.shard.requires_grad]
        self._install_shards()

    def _install_shards(self):
        for p in self.params:
            for sub, name in p.uses:
                sub._parameters[name] = p.shard

    def gather(self):
        """All-gather every parameter into its full storage (one collective per dtype)."""
        for group in _by_dtype(self.params, key=lambda p: p.shard):
            send = torch.cat([p.shard.detach() for p in group])
            recv = torch.empty(self.world * send.numel(), dtype=send.dtype, device=send.device)
            dist.all_gather_into_tensor(recv, send, group=self.group)
            recv = recv.view(self.world, send.numel())   # row r: rank r's pieces, back to back
            offset = 0
            with torch.no_grad():
                for p in group:
                    p.allocate()
                    # Written through .data, whose version counter is its own: the views autograd
                    # saved in forward must not look modified when they are gathered again.
                    p.full.data.view(self.world, p.chunk).copy_(recv[:, offset:offset + p.chunk])
                    offset += p.chunk
        self.gathered = True

    def reshard(self):
        for p in self.params:
            p.free()
        self.gathered = False

    def reduce_scatter(self, grads):
        """This rank's piece of each gradient: summed over ranks, divided by the divisor."""
        pieces = [None] * len(self.trainable)
        used = [(i, g) for i, g in enumerate(grads) if g is not None]
        for group in _by_dtype(used, key=lambda item: item[1]):
            width = sum(self.trainable[i].chunk for i, _ in group)
            send = torch.empty(self.world, width, dtype=group[0][1].dtype, device=group[0][1].device)
            offset = 0
            for i, g in group:
                p = self.trainable[i]
                flat = F.pad(g.reshape(-1), (0, p.chunk * self.world - p.numel))
                send[:, offset:offset + p.chunk] = flat.view(self.world, p.chunk)
                offset += p.chunk
            recv = torch.empty(width, dtype=send.dtype, device=send.device)
            dist.reduce_scatter_tensor(recv, send.view(-1), op=dist.ReduceOp.SUM, group=self.group)
            recv.div_(self.divisor)
            offset = 0
            for i, _ in group:
                chunk = self.trainable[i].chunk
                pieces[i] = recv[offset:offset + chunk].clone()
                offset += chunk
        # Every use of the trainable full parameters is done; a frozen one may still be needed
        # (for an input's gradient) by nodes that do not wait for this one: the final callback
        # frees those units.
        if not self.frozen:
            self.reshard()
        return pieces

    # ---- hooks ---------------------------------------------------------------------------------

    def pre_forward(self, module, args):
        # Always gather: the shards may have been stepped since the last gather. (Regathering
        # unchanged shards writes the same values, so this is harmless when already gathered.)
        self.gather()
        fulls = _Unshard.apply(self, *[p.shard for p in self.trainable]) if self.trainable else ()
        for p, full in zip(self.trainable, fulls):
            for sub, name in p.uses:
                sub._parameters[name] = full
        for p in self.frozen:
            view = p.full_view()
            for sub, name in p.uses:
                sub._parameters[name] = view

    def post_forward(self, module, args, output):
        self._install_shards()                 # parameters() shows the shards again
        if self.reshard_after_forward and not self.is_root:
            self.reshard()                     # gathered again before backward needs it
        for tensor in _tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(self._pre_backward_hook)
        return output

    def _pre_backward_hook(self, grad):
        _queue_final_callback()
        _touched_units.add(self)
        if not self.gathered:
            self.gather()
        return None


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)


def fully_shard(module, group=None, reshard_after_forward=True, compute_dtype=None,
                gradient_divide_factor=None):
    """Shard ``module``'s parameters (those no unit below took) over ``group``; returns module."""
    if compute_dtype is not None:
        raise NotImplementedError("compute_dtype (capability fsdp_compute_dtype) is not provided")
    if hasattr(module, "_fs_unit"):
        return module
    # Units are sharded first; the module sharded now is the root of those below it, which
    # therefore are not roots any more (only the root keeps its parameters through forward).
    for sub in module.modules():
        unit = getattr(sub, "_fs_unit", None)
        if unit is not None:
            unit.is_root = False
    unit = _FullyShardedUnit(module, group, reshard_after_forward, gradient_divide_factor)
    module._fs_unit = unit
    module.register_forward_pre_hook(unit.pre_forward)
    module.register_forward_hook(unit.post_forward)
    return module


def full_parameters(module):
    """``{name: full tensor}`` for every parameter, named as before sharding (a collective)."""
    result = {}
    for name, param in module.named_parameters():   # a tied parameter: once, first name
        sharded = getattr(param, "_fs_sharded", None)
        if sharded is None:
            result[name] = param.detach().clone()
            continue
        full = torch.empty(sharded.chunk * sharded.world, dtype=param.dtype, device=param.device)
        dist.all_gather_into_tensor(full, param.detach(), group=sharded.group)
        result[name] = full[: sharded.numel].view(sharded.shape).clone()
    return result
