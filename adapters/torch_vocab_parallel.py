"""torch's own vocabulary-parallel loss behind the suite's contract:
``torch.distributed.tensor.parallel.loss_parallel``, under which ``F.cross_entropy`` on logits
that are a DTensor sharded along the class dimension computes the loss without gathering them
(the same max / sum-of-exp / target-logit reductions). The contract's padding columns (>= V) are
masked to -inf first, as a padded vocabulary is masked in practice, so that they never reach the
softmax. torch requires the backward of such a loss to run inside ``loss_parallel`` too, and the
contract's caller calls backward itself: the loss is therefore wrapped in an autograd function
whose backward enters ``loss_parallel`` and runs the DTensor graph's backward there."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _LossParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_size, group):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.parallel import loss_parallel

        mesh = DeviceMesh.from_group(group or dist.group.WORLD, logits.device.type)
        width = logits.shape[-1]
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_(True)
            columns = torch.arange(width, device=logits.device) + mesh.get_local_rank() * width
            masked = leaf.masked_fill(columns >= vocab_size, float("-inf"))
            sharded = DTensor.from_local(masked.reshape(-1, width), mesh, [Shard(1)])
            with loss_parallel():
                loss = F.cross_entropy(sharded, targets.reshape(-1), reduction="none")
        ctx.leaf, ctx.loss, ctx.mesh, ctx.replicate = leaf, loss, mesh, Replicate
        local = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        return local.detach().reshape(targets.shape)

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        upstream = grad.reshape(-1).contiguous()
        if isinstance(ctx.loss, DTensor):
            upstream = DTensor.from_local(upstream, ctx.mesh, [ctx.replicate()])
        with loss_parallel():
            ctx.loss.backward(upstream)
        return ctx.leaf.grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, group=None, label_smoothing: float = 0.0):
    if label_smoothing:
        # measured on torch 2.13: F.cross_entropy(..., label_smoothing=0.1) under loss_parallel raises
        # "aten.masked_fill_.Scalar: in-place operations that require placement changes are not supported"
        raise NotImplementedError(
            "torch's loss_parallel cannot take label_smoothing: its documentation says 'Currently not supported' "
            "(torch/distributed/tensor/parallel/loss.py, loss_parallel)"
        )
    return _LossParallel.apply(logits, targets, vocab_size, group)


class VocabParallelEmbedding:
    """torch's ``RowwiseParallel`` on an ``nn.Embedding`` (the table sharded by rows as a DTensor,
    the lookup masked per rank and the partial rows summed), on the table padded with zero rows to
    a multiple of the group, the contract's layout (torch alone would cut V rows by torch.chunk)."""

    @staticmethod
    def from_dense(embedding, group=None):
        from torch import nn
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

        mesh = DeviceMesh.from_group(group or dist.group.WORLD, embedding.weight.device.type)
        vocab, width = embedding.weight.shape
        padded = -(-vocab // mesh.size()) * mesh.size()
        table = nn.Embedding(padded, width, dtype=embedding.weight.dtype, device=embedding.weight.device)
        with torch.no_grad():
            table.weight.zero_()
            table.weight[:vocab] = embedding.weight
        # the token ids are the same on every rank (replicated), not a shard of a longer input
        return parallelize_module(table, mesh, RowwiseParallel(input_layouts=Replicate()))
