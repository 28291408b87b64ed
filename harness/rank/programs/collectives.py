"""Rank programs for the collectives. Each moves this rank's inputs to its device, calls the
implementation under test with torch.distributed's signature, and returns every tensor it passed
(outputs and inputs alike) so the driver can judge results and check inputs were left alone."""

from __future__ import annotations

import torch

from parallelism_conformance.harness.rank.context import RankContext, on_members, require

REDUCTION_ARGUMENT = "op"


def _reduce_op(name: str):
    import torch.distributed as dist

    return getattr(dist.ReduceOp, name)


def keyword_arguments(ctx: RankContext, arguments: dict) -> dict:
    """A call's arguments as the driver sent them (conformance/collective_table.py) ready for the
    call: tensors on this rank's device, the reduction's name as a ReduceOp."""
    kwargs = {k: ctx.to_device(v) for k, v in arguments.items()}
    if REDUCTION_ARGUMENT in kwargs:
        kwargs[REDUCTION_ARGUMENT] = _reduce_op(kwargs[REDUCTION_ARGUMENT])
    return kwargs


@on_members
def call(ctx: RankContext, impl, process_group, function: str, arguments: dict) -> dict | None:
    """``impl.<function>(**arguments, group=...)`` on the members of ``group`` (global ranks; None
    is the whole world). Tensors and lists of tensors come back after the call."""
    kwargs = keyword_arguments(ctx, arguments)
    require(impl, function)(**kwargs, group=process_group)
    return {k: ctx.to_cpu(v) for k, v in kwargs.items() if k != REDUCTION_ARGUMENT}


@on_members
def all_reduce_vs_reduce_scatter_all_gather(ctx: RankContext, impl, process_group, tensor, op):
    """all_reduce(x) and all_gather_into_tensor(reduce_scatter_tensor(x)) on the same input."""
    import torch.distributed as dist

    size = dist.get_world_size(process_group)
    x = ctx.to_device(tensor)
    reduced = x.clone()
    require(impl, "all_reduce")(reduced, op=_reduce_op(op), group=process_group)
    shard = torch.empty(x.numel() // size, dtype=x.dtype, device=x.device)
    require(impl, "reduce_scatter_tensor")(shard, x.clone(), op=_reduce_op(op), group=process_group)
    gathered = torch.empty_like(x)
    require(impl, "all_gather_into_tensor")(gathered, shard, group=process_group)
    return {"all_reduce": ctx.to_cpu(reduced), "composed": ctx.to_cpu(gathered)}


@on_members
def reduce_vs_all_reduce(ctx: RankContext, impl, process_group, tensor, op, dst):
    x = ctx.to_device(tensor)
    at_root = x.clone()
    require(impl, "reduce")(at_root, dst=dst, op=_reduce_op(op), group=process_group)
    everywhere = x.clone()
    require(impl, "all_reduce")(everywhere, op=_reduce_op(op), group=process_group)
    return {"reduce": ctx.to_cpu(at_root), "all_reduce": ctx.to_cpu(everywhere)}


@on_members
def all_to_all_twice(ctx: RankContext, impl, process_group, tensor, input_split_sizes, output_split_sizes):
    """all_to_all_single with splits s, then with the transposed splits: the identity."""
    x = ctx.to_device(tensor)
    exchanged = torch.empty((sum(output_split_sizes), *x.shape[1:]), dtype=x.dtype, device=x.device)
    exchange = require(impl, "all_to_all_single")
    exchange(exchanged, x, output_split_sizes, input_split_sizes, group=process_group)
    back = torch.empty_like(x)
    exchange(back, exchanged, input_split_sizes, output_split_sizes, group=process_group)
    return {"back": ctx.to_cpu(back)}


@on_members
def scatter_then_gather(ctx: RankContext, impl, process_group, scatter_list, output, root):
    piece = ctx.to_device(output)
    is_root = ctx.rank == root
    require(impl, "scatter")(piece, ctx.to_device(scatter_list) if is_root else None, src=root, group=process_group)
    gathered = [torch.empty_like(piece) for _ in scatter_list] if is_root else None
    require(impl, "gather")(piece, gathered, dst=root, group=process_group)
    return {"gathered": ctx.to_cpu(gathered) if is_root else None}
