"""Fully sharded data parallelism (ZeRO stage 3, Rajbhandari et al. 2020; PyTorch FSDP, Zhao et al.
2023), in the style of torch's FSDP2: ``fully_shard(module, group=None)`` is applied to the units of
a model (e.g. each layer), then to the root; it returns the module, whose parameters are then this
rank's shards, so any optimizer built over ``module.parameters()`` keeps 1/n of the optimizer state.

Each trainable parameter is flattened, padded to a multiple of n and cut into n equal pieces; rank
i keeps piece i as the parameter (``named_parameters()`` keeps the names). A unit's forward
all-gathers its parameters' pieces (the all-gather of impls.collectives, from point-to-point
messages), runs with the full tensors and lets them go; backward all-gathers them again (the unit
runs under activation checkpointing, so its forward is recomputed then) and reduce-scatters the
full gradient, divided by n: each rank ends with its piece of the gradient averaged over ranks (the
lecture: an all-reduce is a reduce-scatter then an all-gather; FSDP keeps the two halves apart). A
unit that holds other units (the root) keeps its own gathered parameters from forward to backward,
as FSDP2's root does. Frozen parameters (requires_grad=False) are not sharded; buffers are
broadcast from group rank 0 once. A parameter no forward used keeps .grad None.

``reshard_after_forward=False`` (FSDP2's option; ZeRO-2's traffic and ZeRO-3's sharded state at
rest): a unit keeps the parameters gathered for its forward until its backward has used them,
gathering once per step instead of twice; between steps it holds its pieces only.

``compute_dtype`` (the CS336 handout's name; FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``):
each piece is cast to it before the all-gather, so the messages and the unit's forward and backward
are in it, and so are the floating inputs of the unit's forward (FSDP2's ``cast_forward_inputs``);
the gradient is reduce-scattered in it and the cast's own backward brings the averaged piece back
to the parameter's dtype, so the masters, their .grad and the optimizer state stay there.

``gradient_divide_factor`` f (FSDP2's ``set_gradient_divide_factor``): the reduce-scattered sum is
divided by f instead of n; f = 1 sums, for a loss already divided by the global token count
(impls/token_loss.py).

``full_parameters(module) -> {name: full tensor}`` gathers every parameter (for checkpoints and the
conformance suite's judge).

Never imports reference/.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import collectives

_STATE = "_fully_sharded"  # attribute holding a unit's bookkeeping


class _Gather(torch.autograd.Function):
    """Forward: the full flat parameter from every rank's piece (all-gather). Backward: the full
    gradient's piece of this rank, reduce-scattered and divided by ``divisor`` (n: the mean over
    ranks)."""

    @staticmethod
    def forward(ctx, piece, n, group, divisor):
        ctx.n, ctx.group, ctx.divisor = n, group, divisor
        full = piece.new_empty(piece.numel() * n)
        collectives.all_gather_into_tensor(full, piece.detach().contiguous(), group=group)
        return full

    @staticmethod
    def backward(ctx, grad):
        piece = grad.new_empty(grad.numel() // ctx.n)
        collectives.reduce_scatter_tensor(piece, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return piece / ctx.divisor, None, None, None


class _Unit:
    def __init__(self, module: nn.Module, group, leaf: bool, compute_dtype: torch.dtype | None = None, divide_factor: float | None = None):
        self.group, self.leaf, self.compute_dtype = group, leaf, compute_dtype
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.divisor = self.n if divide_factor is None else divide_factor
        # one entry per parameter object: every (owner, name) that holds it (tied weights), its shape
        self.sharded: list[tuple[list[tuple[nn.Module, str]], torch.Size, int]] = []
        claimed = {id(p) for m in module.modules() if m is not module and hasattr(m, _STATE) for p in getattr(m, _STATE).pieces()}
        holders: dict[int, list[tuple[nn.Module, str]]] = {}
        originals: dict[int, nn.Parameter] = {}
        for owner in module.modules():
            for name, parameter in owner.named_parameters(recurse=False):
                if id(parameter) not in claimed and parameter.requires_grad:
                    holders.setdefault(id(parameter), []).append((owner, name))
                    originals[id(parameter)] = parameter
        for key, places in holders.items():
            original = originals[key]
            piece = nn.Parameter(self._piece(original.detach()))
            for owner, name in places:
                owner._parameters[name] = piece
            self.sharded.append((places, original.shape, original.numel()))

    def _piece(self, full: torch.Tensor) -> torch.Tensor:
        size = -(-full.numel() // self.n)
        flat = torch.zeros(size * self.n, dtype=full.dtype, device=full.device)
        flat[: full.numel()] = full.reshape(-1)
        return flat[self.rank * size : (self.rank + 1) * size].clone()

    def pieces(self) -> list[nn.Parameter]:
        return [places[0][0]._parameters[places[0][1]] for places, _, _ in self.sharded]

    def gathered(self, pieces) -> list[torch.Tensor]:
        dtype = self.compute_dtype
        return [
            _Gather.apply(piece if dtype is None else piece.to(dtype), self.n, self.group, self.divisor)[:numel].view(shape)
            for piece, (_, shape, numel) in zip(pieces, self.sharded)
        ]

    def cast_inputs(self, args):
        if self.compute_dtype is None:
            return args
        return tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    def run(self, forward, args, kwargs):
        """``forward`` with the unit's parameters replaced by their full tensors for the call."""
        pieces = self.pieces()

        def with_full(*pieces_and_args):
            fulls = self.gathered(pieces_and_args[: len(pieces)])
            for (places, _, _), full in zip(self.sharded, fulls):
                for owner, name in places:
                    del owner._parameters[name]
                    setattr(owner, name, full)
            try:
                return forward(*pieces_and_args[len(pieces) :], **kwargs)
            finally:
                for (places, _, _), piece in zip(self.sharded, pieces):
                    for owner, name in places:
                        delattr(owner, name)
                        owner._parameters[name] = piece

        if self.leaf and torch.is_grad_enabled():  # resharded after forward, gathered again in backward
            return checkpoint(with_full, *pieces, *self.cast_inputs(args), use_reentrant=False)
        return with_full(*pieces, *self.cast_inputs(args))


def fully_shard(
    module: nn.Module,
    group=None,
    reshard_after_forward: bool = True,
    compute_dtype: torch.dtype | None = None,
    gradient_divide_factor: float | None = None,
) -> nn.Module:
    """Shard ``module``'s trainable parameters not already held by an inner unit; returns it."""
    if hasattr(module, _STATE):
        raise ValueError(f"{type(module).__name__} is already fully sharded")
    leaf = not any(hasattr(m, _STATE) for m in module.modules() if m is not module)
    with torch.no_grad():
        for buffer in module.buffers():
            collectives.broadcast(buffer, group=group, group_src=0)
    unit = _Unit(module, group, leaf and reshard_after_forward, compute_dtype, gradient_divide_factor)
    setattr(module, _STATE, unit)
    forward = module.forward
    module.forward = lambda *args, **kwargs: unit.run(forward, args, kwargs)
    return module


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """{name: the full parameter} for every parameter of ``module`` (sharded ones all-gathered)."""
    owners = {}
    for m in module.modules():
        unit = getattr(m, _STATE, None)
        if unit is not None:
            for piece, (_, shape, numel) in zip(unit.pieces(), unit.sharded):
                owners[id(piece)] = (unit, shape, numel)
    result = {}
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if id(parameter) in owners:
                unit, shape, numel = owners[id(parameter)]
                full = parameter.new_empty(parameter.numel() * unit.n)
                collectives.all_gather_into_tensor(full, parameter.detach().contiguous(), group=unit.group)
                result[name] = full[:numel].view(shape).clone()
            else:
                result[name] = parameter.detach().clone()
    return result
