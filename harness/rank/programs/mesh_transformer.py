"""Rank program for the whole block on a pp x dp x tp mesh (capability ``mesh_transformer``): a small
language model (harness/rank/pipeline_models.py, ``build_transformer``: a tied embedding and head,
blocks of causal self-attention and SwiGLU with residuals) on the implementation's layers.

Rank (s dp + d) tp + t builds stage s of its pipeline: on the first and the last stage the
vocabulary-parallel embedding (``VocabParallelEmbedding.from_dense`` on its tensor-parallel group:
the first stage looks tokens up in it, the last uses its rows as the head, logits = h E_r^T, this
rank's logit columns), and the stage's blocks, each ``TensorParallelAttention.from_dense`` and
``TensorParallelSwiGLU.from_dense`` on the tensor-parallel group, x + attn(x) then x + mlp(x). The
stack runs in ``pipeline_step`` on the pipeline group with loss_fn the mean of
``vocab_parallel_cross_entropy`` over the tensor-parallel group; ``sync_tied_gradients`` then sums
the embedding's two uses over the pipeline group (the first and last stage), and every gradient
shard is averaged over the data-parallel group with the implementation's ``all_reduce``. Returns
the loss (None off the last stage), the stage, and the gradient shards keyed
``stage<s>.<the dense model's name>``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ReduceOp

from parallelism_conformance.harness.rank import pipeline_models
from parallelism_conformance.harness.rank.context import RankContext, require
from parallelism_conformance.harness.rank.programs.tensor_parallel import _gradient

LAYERS = (("attn", "qkv"), ("attn", "out"), ("mlp", "gate_up"), ("mlp", "down"))


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class _ToTheHead(torch.autograd.Function):
    """Megatron's f before the head, a column-parallel layer: identity forward; backward, the sum over
    the tensor-parallel group of each rank's dL/dx from its logit columns (the implementation's
    all_reduce), since every column contributes to the gradient of the replicated input."""

    @staticmethod
    def forward(ctx, x, all_reduce, group):
        ctx.all_reduce, ctx.group = all_reduce, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _Stage(nn.Module):
    def __init__(self, embed, blocks: list, first: bool, last: bool, all_reduce, tp_group):
        super().__init__()
        self.embed, self.blocks, self.first, self.last = embed, nn.ModuleList(blocks), first, last
        self.all_reduce, self.tp_group = all_reduce, tp_group

    def forward(self, x):
        if self.first:
            x = self.embed(x)
        for block in self.blocks:
            x = x + block["attn"](x)
            x = x + block["mlp"](x)
        if self.last:  # the head is the embedding (tied): this rank's vocabulary rows give its logit columns
            x = _ToTheHead.apply(x, self.all_reduce, self.tp_group) @ _local(self.embed.weight).T
        return x


def transformer_step(
    ctx: RankContext,
    impl,
    model: dict,
    seed: int,
    blocks_per_stage: list[int],
    num_microbatches: int,
    mesh: dict,
    inputs=None,
    targets=None,
    schedule: str = "1f1b",
    group=None,
) -> dict:
    """One step of the whole model on the mesh (``mesh``: {"pp": [...], "dp": [...], "tp": [...]},
    every rank creates all the groups in that order); see the module docstring."""
    if group is not None:
        raise ValueError("a mesh spans the whole world")
    for axis in ("tp", "dp", "pp"):
        for members in mesh[axis]:
            ctx.group(members)
    mine = {axis: next(g for g in mesh[axis] if ctx.rank in g) for axis in ("pp", "dp", "tp")}
    pp, dp, tp = (ctx.group(mine[axis]) for axis in ("pp", "dp", "tp"))
    stage, last = mine["pp"].index(ctx.rank), len(mine["pp"]) - 1
    dense = pipeline_models.build_transformer(model, seed).to(ctx.device)
    first_block = sum(blocks_per_stage[:stage])
    attention, swiglu = require(impl, "TensorParallelAttention"), require(impl, "TensorParallelSwiGLU")
    blocks = []
    for b in range(first_block, first_block + blocks_per_stage[stage]):
        weights = dense.blocks[b]
        blocks.append(
            nn.ModuleDict(
                {
                    "attn": attention.from_dense(
                        weights.attn.qkv, weights.attn.out, model["heads"], model["kv_heads"], group=tp, qkv_layout=model["layout"]
                    ),
                    "mlp": swiglu.from_dense(weights.mlp.gate_up, weights.mlp.down, group=tp),
                }
            )
        )
    embed = require(impl, "VocabParallelEmbedding").from_dense(dense.embed, group=tp) if stage in (0, last) else None
    module = _Stage(embed, blocks, stage == 0, stage == last, require(impl, "all_reduce"), tp)
    cross_entropy = require(impl, "vocab_parallel_cross_entropy")

    def loss_fn(logits, target):
        return cross_entropy(logits, target, model["vocab"], group=tp).mean()

    loss = require(impl, "pipeline_step")(
        module, ctx.to_device(inputs), ctx.to_device(targets), loss_fn, num_microbatches, schedule=schedule, group=pp
    )
    require(impl, "sync_tied_gradients")(module, [(0, "embed.weight"), (last, "embed.weight")], group=pp)
    named = [("embed.weight", embed.weight)] if embed is not None else []
    for i, block in enumerate(blocks):
        for part, layer in LAYERS:
            for kind in ("weight", "bias"):
                parameter = getattr(getattr(block[part], layer), kind, None)
                if parameter is not None:
                    named.append((f"blocks.{first_block + i}.{part}.{layer}.{kind}", parameter))
    all_reduce, grads = require(impl, "all_reduce"), {}
    for name, parameter in named:
        if parameter.grad is None:
            grads[f"stage{stage}.{name}"] = None
            continue
        shard = _local(_gradient(parameter)).detach().clone().contiguous()
        all_reduce(shard, op=ReduceOp.SUM, group=dp)
        grads[f"stage{stage}.{name}"] = shard / len(mine["dp"])
    return ctx.to_cpu({"loss": loss, "grads": grads, "stage": stage})
