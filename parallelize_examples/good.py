"""Known-good parallelize functions (``--parallelize parallelize_examples/good.py:NAME``): torch's
own FSDP2 and tensor-parallel styles on harness/rank/decoder_lm.py's module paths, as torchtitan's
``parallelize_llama`` applies them. Each declares the mesh dimensions it handles (``mesh_dims``).
All of them run on gloo CPU ranks with torch 2.13 (DTensor's CPU ops, FSDP2's reduce-scatter).

Not here: loss parallel, and the composable ``replicate`` (HSDP's replicate dimension stands in for
it). In ``tensor_parallel`` the norms, embedding and head are replicated over tp: each tp rank
computes their whole, identical gradient, which needs no reduction; ``sequence_parallel`` shards
them along the sequence as torchtitan does."""

from __future__ import annotations

from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module

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


def sequence_parallel(model, mesh):
    """torchtitan's Llama plan (``apply_tp``, without loss parallel): the embedding row-parallel with
    its output sharded along the sequence, the norms ``SequenceParallel`` (each tp rank normalises its
    tokens), attention and SwiGLU gathering the sequence on entry and reduce-scattering it on exit
    (``RowwiseParallel(output_layouts=Shard(1))``), the head column-parallel from the sequence shards
    to whole logits. The residual stream between blocks is a DTensor sharded along the sequence."""
    parallelize_module(
        model,
        mesh["tp"],
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        **TP_PLAN,
        "attention_norm": SequenceParallel(),
        "attention": gather,
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": gather,
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.layers:
        parallelize_module(block, mesh["tp"], plan)
    return model


sequence_parallel.mesh_dims = ("tp",)
sequence_parallel.divisible_by_tp = ("seq", "vocab")  # uneven shards of either fail in torch 2.13 (test_parallelize.py)


def ddp(model, mesh):
    """torch's DistributedDataParallel across dp_replicate (its gradient all-reduce, averaged): the
    model comes back wrapped, its names under ``module.`` (the suite takes the wrapper's part out)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=mesh.get_group("dp_replicate"))


ddp.mesh_dims = ("dp_replicate",)


def fsdp_checkpointed(model, mesh):
    """``fsdp`` with each block's activations recomputed in backward (torchtitan applies activation
    checkpointing before FSDP, ``checkpoint_wrapper``: names gain ``_checkpoint_wrapped_module``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)
    return fsdp(model, mesh)


fsdp_checkpointed.mesh_dims = ("dp_shard",)


def torchtitan_form_fsdp_tp(model, parallel_dims, job_config):
    """``fsdp_tp`` written against torchtitan's interface (``form = "torchtitan"``): the meshes from
    ``parallel_dims.get_mesh`` ("tp" where tp is enabled; "fsdp" always exists), and gradients summed
    over the data-parallel ranks as torchtitan's ``disable_fsdp_gradient_division`` leaves them (this
    form's loss is torchtitan's, over the global token count); summed with SUM and a factor of 1
    after it (``set_force_sum_reduction_for_comms``): gloo has no PREMUL_SUM. Runs with torchtitan's
    own ParallelDims or, where torchtitan does not import, the suite's stand-in."""
    if parallel_dims.tp_enabled:
        for block in model.layers:
            parallelize_module(block, parallel_dims.get_mesh("tp"), TP_PLAN)
    dp = parallel_dims.get_mesh("fsdp")
    for module in [*model.layers, model]:
        fully_shard(module, mesh=dp)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return model


torchtitan_form_fsdp_tp.form = "torchtitan"
torchtitan_form_fsdp_tp.mesh_dims = ("dp_shard", "tp")
