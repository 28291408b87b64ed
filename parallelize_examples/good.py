"""Known-good parallelize functions (``--parallelize parallelize_examples/good.py:NAME``): torch's
own FSDP2 and tensor-parallel styles on harness/rank/decoder_lm.py's module paths, as torchtitan's
``parallelize_llama`` applies them. Each declares the mesh dimensions it handles (``mesh_dims``).
All of them run on gloo CPU ranks with torch 2.13 (DTensor's CPU ops, FSDP2's reduce-scatter).

Not here: ``SequenceParallel`` on the norms and loss parallel (the model's norms and head are
replicated over tp here: each tp rank computes their whole, identical gradient, which needs no
reduction), and the composable ``replicate`` (HSDP's replicate dimension stands in for it)."""

from __future__ import annotations

from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

# Megatron's pairing (Shoeybi et al. 2019): column-parallel projections out of the residual stream
# (each tp rank its heads, its ffn columns), row-parallel back into it (the partial products summed
# by an all-reduce), so the stream between blocks is whole on every tp rank.
TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def tensor_parallel(model, mesh):
    """Every block's attention and SwiGLU on the tp dimension (TP_PLAN)."""
    for block in model.layers:
        parallelize_module(block, mesh["tp"], TP_PLAN)
    return model


tensor_parallel.mesh_dims = ("tp",)


def fsdp(model, mesh):
    """FSDP2 on dp_shard: each block a unit, then the root (the embedding, final norm and head)."""
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    return fully_shard(model, mesh=mesh["dp_shard"])


fsdp.mesh_dims = ("dp_shard",)


def hsdp(model, mesh):
    """FSDP2 hybrid: sharded within dp_shard, replicated across dp_replicate (gradients
    reduce-scattered, then all-reduced across replicas), each block a unit, then the root."""
    dp = mesh["dp_replicate", "dp_shard"]
    for block in model.layers:
        fully_shard(block, mesh=dp)
    return fully_shard(model, mesh=dp)


hsdp.mesh_dims = ("dp_replicate", "dp_shard")


def fsdp_tp(model, mesh):
    """2-D: TP_PLAN on tp first, then FSDP2 on dp_shard over the tensor-parallel DTensors."""
    tensor_parallel(model, mesh)
    return fsdp(model, mesh)


fsdp_tp.mesh_dims = ("dp_shard", "tp")
