"""A sharded optimizer: ZeRO stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020, sec. 5.1, P_os), for data parallelism.

Every rank keeps the whole model and computes gradients on its own slice of the batch, as in plain
data parallelism, but the optimizer state (SGD's momentum, Adam's two moments: K elements per
parameter element) is split: each trainable parameter is owned by one rank, which alone keeps its
state and updates it. Per step:

1. reduce: each owner receives the sum over ranks of its parameters' gradients and divides by n,
   g = (1/n) sum_r g_r (the global-batch gradient, as in data parallelism). One reduce per owner,
   of its gradients flattened into one buffer: together, a reduce-scatter with uneven shards, the
   step the lecture stops at when "the next step requires only one shard per device";
2. step: the owner's local optimizer (``self.optim``, a torch.optim optimizer over its parameters
   only) updates them;
3. broadcast: each owner sends the parameters it updated to every rank (an all-gather of the
   shards), so every rank ends the step with the same parameters.

Memory: optimizer state K P / n per rank instead of K P, at the cost of the broadcast in step 3.
Owners are chosen greedily, largest parameter first, each to the least-loaded rank (LPT), so no
rank holds more than P / n + the largest parameter's elements; the same on every rank (the
assignment depends on shapes only).

Which parameters take part is decided per step, identically on every rank (the contract's data
parallelism assumption): a frozen parameter (requires_grad=False) never has an owner nor state; a
parameter whose .grad is None in a step (no forward used it) is left out of that step's
reduction, and its owner's optimizer skips it, as torch's optimizers do in one process.

Communication goes through :mod:`impls.collectives` (point-to-point based); torch.distributed is
used for group bookkeeping only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives


def assign_owners(sizes: list[int], world_size: int) -> list[int]:
    """Owner (group rank) of each parameter: largest first (ties: registration order) to the rank
    with the fewest elements so far (ties: the lowest rank)."""
    loads = [0] * world_size
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += sizes[index]
    return owners


class ShardedOptimizer:
    """``ShardedOptimizer(params, optimizer_class, group=None, **defaults)``: ``optimizer_class``
    (e.g. torch.optim.AdamW) with ``defaults`` over this rank's share of ``params``; ``step()``
    averages gradients over the group, updates each parameter on its owner and broadcasts it."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        params = list(params)
        if any(isinstance(p, dict) for p in params):
            raise TypeError("ShardedOptimizer takes a flat iterable of parameters, not parameter groups")
        unique = list({id(p): p for p in params}.values())
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.params = [p for p in unique if p.requires_grad]
        self.owners = assign_owners([p.numel() for p in self.params], self.world_size)
        mine = [p for p, owner in zip(self.params, self.owners) if owner == self.rank]
        # A rank that owns nothing still has an optimizer (torch refuses an empty list): over a
        # placeholder that never gets a gradient, so it never holds state.
        self.optim = optimizer_class(mine or [torch.zeros(0, requires_grad=True)], **defaults)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        for owner in range(self.world_size):
            self._reduce_to(owner)
        self.optim.step()
        for owner in range(self.world_size):
            self._broadcast_from(owner)

    def _updated_by(self, owner: int) -> list[torch.Tensor]:
        """The owner's parameters that have a gradient in this step: the ones it updates."""
        return [p for p, o in zip(self.params, self.owners) if o == owner and p.grad is not None]

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _reduce_to(self, owner: int) -> None:
        params = self._updated_by(owner)
        if not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        collectives.reduce(flat, dst=self._global(owner), op=dist.ReduceOp.SUM, group=self.group)
        if owner == self.rank:
            flat /= self.world_size
            for p, piece in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(piece.view_as(p.grad))

    def _broadcast_from(self, owner: int) -> None:
        params = self._updated_by(owner)  # the others are unchanged, hence still equal everywhere
        if not params:
            return
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        collectives.broadcast(flat, src=self._global(owner), group=self.group)
        if owner != self.rank:
            for p, piece in zip(params, flat.split([p.numel() for p in params])):
                p.copy_(piece.view_as(p))
