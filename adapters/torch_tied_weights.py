"""The contract's ``sync_tied_gradients(stages, tied, group=None)`` (CONTRACT.md, "A weight tied
across stages") on torch.distributed's own all-reduce: torch.distributed.pipelining has no tied
weights across stages (torchtitan unties the embedding and the head under pipeline parallelism), so
this is what a torch user writes, Megatron-LM's embedding-group all-reduce: the ranks holding a
copy (stage s on group rank s % p) form a process group, made once per set of holders by every
rank of the world (``new_group`` is collective over the world, and every rank calls this
function; on a mesh every pipeline's holders are exchanged first), and all-reduce the sum of their
distinct copies' gradients (a DTensor's local shards); every copy gets the result.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["sync_tied_gradients"]

_groups: dict = {}


def _holders_group(holders: tuple[int, ...]):
    if holders not in _groups:
        _groups[holders] = dist.new_group(list(holders))
    return _groups[holders]


def sync_tied_gradients(stages, tied, group=None) -> None:
    p, me = dist.get_world_size(group), dist.get_rank(group)
    modules = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    owners = sorted({stage % p for stage, _ in tied})
    holders = tuple(dist.get_global_rank(group, r) if group is not None else r for r in owners)
    # new_group is collective over the world: on a mesh, each pipeline has holders of its own, so
    # every rank learns every pipeline's and makes all their groups in the same order
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, holders)
    for members in sorted(set(everyone)):
        _holders_group(members)
    subgroup = _holders_group(holders)
    if me not in owners:
        return
    copies = []
    for stage, name in tied:
        if stage % p == me:
            parameter = modules[stage // p].get_parameter(name)
            if all(parameter is not seen for seen in copies):
                copies.append(parameter)
    # a DTensor copy (a vocabulary-parallel table, sharded over a tensor-parallel group) is summed
    # shard by shard: c10d's all_reduce takes local tensors only
    for c in copies:  # torch 2.13 leaves a row-sharded embedding's gradient replicated: laid out as its table first
        if hasattr(c.grad, "redistribute") and c.grad.placements != c.placements:
            c.grad = c.grad.redistribute(placements=c.placements)
    grads = [c.grad.to_local() if hasattr(c.grad, "to_local") else c.grad for c in copies]
    total = sum(grads[1:], grads[0].detach().clone())
    dist.all_reduce(total, group=subgroup)
    for grad in grads:
        grad.copy_(total)
