"""A sharded optimizer: ZeRO stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020, sec. 5.1, P_os), for data parallelism.

Every rank keeps the whole model and computes gradients on its own slice of the batch, as in plain
data parallelism, but the optimizer state (SGD's momentum, Adam's two moments: K elements per
parameter element) is split: each trainable parameter is owned by one rank, which alone keeps its
state and updates it. Owner o's parameters, flattened in order, fill slot o of a flat buffer of n
equal slots of B elements (B = the largest owner's total, the rest of a slot is padding). Per step:

1. reduce-scatter (AVG) of the gradients laid out in the slots: each owner receives the mean over
   ranks of its parameters' gradients, g = (1/n) sum_r g_r (the global-batch gradient, as in data
   parallelism); the lecture's point that one may "stop after reduce-scatter" when the next step
   needs only one shard per device;
2. step: the owner's local optimizer (``self.optim``, a torch.optim optimizer over its parameters
   only) updates them;
3. all-gather of the parameters laid out in the slots: every rank ends the step with the owners'
   updated parameters.

Communication: a reduce-scatter and an all-gather of n B elements, 2 (n-1) B per rank over a ring,
the same as data parallelism's all-reduce of the P parameters, 2 (n-1) P / n, up to the padding;
memory: optimizer state K P / n per rank instead of K P. Owners are chosen greedily, largest
parameter first, each to the least-loaded rank (LPT), so B <= P / n + the largest parameter; the
same on every rank (the assignment depends on shapes only).

Which parameters take part is decided per step, identically on every rank (the contract's data
parallelism assumption): a frozen parameter (requires_grad=False) never has an owner nor state; a
parameter whose .grad is None in a step (no forward used it) fills its slot with zeros, keeps
.grad None on its owner, and so is skipped by the owner's optimizer, as torch's optimizers do in
one process; nobody copies it back, since it did not change.

Communication goes through :mod:`impls.collectives` (point-to-point based); torch.distributed is
used for group bookkeeping only. Parameters of one dtype and device (a flat buffer holds them all).
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
    averages gradients over the group (reduce-scatter), updates each parameter on its owner, and
    all-gathers the updated parameters."""

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
        filled = [0] * self.world_size
        self.offsets = []  # where each parameter starts in the flat buffer of n slots
        for p, owner in zip(self.params, self.owners):
            self.offsets.append(filled[owner])
            filled[owner] += p.numel()
        self.slot = max(filled)  # B: every slot as long as the largest owner's share
        self.offsets = [owner * self.slot + at for owner, at in zip(self.owners, self.offsets)]
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
        if all(p.grad is None for p in self.params):  # the same on every rank
            return
        if self.world_size == 1:  # the mean over one rank is its own gradient; nothing to share
            self.optim.step()
            return
        mine = self._average_my_gradients()
        self.optim.step()
        self._share_my_parameters(mine)

    def _slots(self) -> torch.Tensor:
        like = self.params[0]
        return torch.zeros(self.world_size * self.slot, dtype=like.dtype, device=like.device)

    def _mine(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its piece of ``slots``) for the parameters this rank owns."""
        return [(p, slots[at : at + p.numel()]) for p, at, owner in zip(self.params, self.offsets, self.owners) if owner == self.rank]

    def _average_my_gradients(self) -> torch.Tensor:
        """Step 1: reduce-scatter (AVG); this rank's parameters get the mean gradient. Returns the
        buffer of n slots, this rank's slot holding the result."""
        slots = self._slots()
        for p, at in zip(self.params, self.offsets):
            if p.grad is not None:
                slots[at : at + p.numel()] = p.grad.reshape(-1)
        mine = slots[self.rank * self.slot : (self.rank + 1) * self.slot]
        collectives.reduce_scatter_tensor(mine, slots.clone(), op=dist.ReduceOp.AVG, group=self.group)
        for p, piece in self._mine(slots):
            if p.grad is not None:
                p.grad.copy_(piece.view_as(p.grad))
        return slots

    def _share_my_parameters(self, slots: torch.Tensor) -> None:
        """Step 3: all-gather; every rank copies in the parameters their owners updated."""
        for p, piece in self._mine(slots):
            piece.copy_(p.detach().reshape(-1))
        mine = slots[self.rank * self.slot : (self.rank + 1) * self.slot].clone()
        collectives.all_gather_into_tensor(slots, mine, group=self.group)
        for p, at, owner in zip(self.params, self.offsets, self.owners):
            if owner != self.rank and p.grad is not None:  # the others did not change
                p.copy_(slots[at : at + p.numel()].view_as(p))
