"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, section 3; sequence parallelism after
Korthikanti et al. 2022, section 4.2.2), on the bundled point-to-point collectives.

A Linear y = x W^T + b, W of shape [out_features, in_features], split across the n ranks of a group:

* ColumnParallelLinear keeps rows r of W (out_features split in n contiguous chunks) and that chunk
  of b: y_r = f(x) W_r^T + b_r is this rank's slice of y's last dim. f is identity forward and
  all-reduce backward, since dL/dx = sum_r g_r W_r. With gather_output the slices are all-gathered
  along the last dim (backward: keep this rank's slice of the gradient).
* RowParallelLinear keeps columns r of W (in_features split) and the whole b: y = g(x_r W_r^T) + b,
  g all-reduce forward, identity backward; the bias is added once, after the reduction, and its
  gradient is the full sum over rows on every rank (not n times). With input_is_parallel=False the
  layer takes the full x and slices its last dim itself (backward: all-gather of the slices).
* TensorParallelMLP: column (no gather), exact GELU, row. Exactly one all-reduce forward (g) and one
  backward (f). With sequence_parallel=True the input and output are this rank's contiguous shard
  of the sequence (dim -2): f becomes an all-gather along the sequence (backward: reduce-scatter)
  and g a reduce-scatter (backward: all-gather). The row layer's bias is then added to a sequence
  shard, so each rank's bias gradient covers its shard only; the bias goes through f (identity
  forward, all-reduce backward) to make its gradient the full one on every rank, as Megatron
  all-reduces the gradients of sequence-parallel parameters.
* ``dropout=p``: the hidden activations (the sharded region) and the output (the replicated region,
  or its sequence shards) are dropped with the masks torch's dropout would draw over the dense
  tensors, each rank keeping its part of them (every member draws the whole mask from the default
  generator, which the members keep in the same state), so the block is the dense one with dropout.
* ``compute_dtype=d`` (the MLP's): the parameters stay the masters in their dtype and are cast to d
  where used, the input too, so the matmuls and the activations' reductions run in d and every
  gradient lands in the parameter's dtype; the one gradient reduced across the group under sequence
  parallelism, the row layer's bias's, is summed in the bias's own dtype (the cast after f).
* ``norm`` (a LayerNorm before fc1, the block's pre-norm): a copy held whole on every rank. Without
  sequence parallelism it normalises the replicated input, and f after it hands every rank the
  full input gradient, so its gradients are whole already. With sequence parallelism it runs on
  the sequence shard, before f's all-gather, and its weight and bias go through f like the row
  layer's bias: their gradients are all-reduced over the group (Megatron-LM#1446, gpt-neox#1257:
  without it they differ per rank).

``group=None`` is the whole world; any subgroup works. Sizes that do not split into n equal chunks
raise a ValueError naming the dimension, its size and the group size before any communication.
Communication goes through :mod:`impls.collectives`, whose all_gather_into_tensor and
reduce_scatter_tensor split along dim 0 of contiguous tensors: the split dim is moved to the front
and back. torch.distributed is used for group bookkeeping only.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .collectives import all_gather_into_tensor, all_reduce, reduce_scatter_tensor

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP"]

SEQUENCE_DIM = -2


# ------------------------------------------------------------------------------------- helpers
def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


def _check_divisible(dimension: str, size: int, n: int) -> None:
    if size % n:
        raise ValueError(f"{dimension} = {size} is not divisible by the group size {n} ({size} % {n} = {size % n})")


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()
    if _size(group) > 1:
        all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's x along ``dim`` in group-rank order."""
    n = _size(group)
    if n == 1:
        return x.clone()
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into_tensor(out, front, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over ranks, keep this rank's chunk along ``dim``."""
    n = _size(group)
    if n == 1:
        return x.clone()
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // n, *front.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous chunk along ``dim`` (no communication)."""
    n = _size(group)
    each = x.shape[dim] // n
    return x.narrow(dim, _rank(group) * each, each).clone()


# ---------------------------------------------------------------- Megatron's conjugate operators
class _CopyToParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromParallelRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromParallelRegion(torch.autograd.Function):
    """All-gather along ``dim`` forward; keep this rank's chunk backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _ScatterToParallelRegion(torch.autograd.Function):
    """Keep this rank's chunk along ``dim`` forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherSequence(torch.autograd.Function):
    """Sequence-parallel f: all-gather along ``dim`` forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence-parallel g: reduce-scatter along ``dim`` forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_parallel_region(x, group=None):
    return _CopyToParallelRegion.apply(x, group)


def reduce_from_parallel_region(x, group=None):
    return _ReduceFromParallelRegion.apply(x, group)


def gather_from_parallel_region(x, group=None):
    return _GatherFromParallelRegion.apply(x, -1, group)


def scatter_to_parallel_region(x, group=None):
    return _ScatterToParallelRegion.apply(x, -1, group)


def gather_from_sequence_parallel_region(x, group=None):
    return _GatherSequence.apply(x, SEQUENCE_DIM, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    return _ReduceScatterSequence.apply(x, SEQUENCE_DIM, group)


def _check_sequence(x: torch.Tensor, group) -> None:
    if x.dim() < 2:
        raise ValueError(f"sequence parallelism needs inputs of shape [..., sequence, hidden], got {tuple(x.shape)}")


def _parameter(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach().clone())


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` in the compute dtype (a differentiable cast: the gradient comes back in t's dtype)."""
    return t if t is None or dtype is None else t.to(dtype)


# -------------------------------------------------------------------------------------- layers
class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r with W_r, b_r this rank's chunk of out_features."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, group=None, gather_output: bool = False, sequence_parallel: bool = False
    ):
        super().__init__()
        self.group = group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.weight = _parameter(weight)
        self.bias = _parameter(bias)
        self.compute_dtype = None  # set by TensorParallelMLP(compute_dtype=...): the parameters cast when used

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, gather_output: bool = False, sequence_parallel: bool = False) -> ColumnParallelLinear:
        n, r = _size(group), _rank(group)
        _check_divisible("out_features", linear.out_features, n)
        each = linear.out_features // n
        weight = linear.weight[r * each : (r + 1) * each]
        bias = None if linear.bias is None else linear.bias[r * each : (r + 1) * each]
        return cls(weight, bias, group, gather_output, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            _check_sequence(x, self.group)
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_parallel_region(x, self.group)
        y = F.linear(x, _cast(self.weight, self.compute_dtype), _cast(self.bias, self.compute_dtype))
        return gather_from_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b with W_r this rank's chunk of in_features."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, group=None, input_is_parallel: bool = True, sequence_parallel: bool = False
    ):
        super().__init__()
        self.group = group
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = _parameter(weight)
        self.bias = _parameter(bias)
        self.compute_dtype = None  # set by TensorParallelMLP(compute_dtype=...)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, input_is_parallel: bool = True, sequence_parallel: bool = False) -> RowParallelLinear:
        n, r = _size(group), _rank(group)
        _check_divisible("in_features", linear.in_features, n)
        each = linear.in_features // n
        weight = linear.weight[:, r * each : (r + 1) * each]
        return cls(weight, linear.bias, group, input_is_parallel, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, self.group)
        partial = F.linear(x, _cast(self.weight, self.compute_dtype))
        if self.sequence_parallel:
            _check_sequence(partial, self.group)
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)
            # the bias meets one sequence shard: all-reduce its gradient (f) to cover the whole sequence,
            # in the bias's own dtype: f on the master, then the cast, so that the cast's backward brings
            # each member's partial gradient back up before the sum (pytorch#190626 summed in bfloat16)
            return y if self.bias is None else y + _cast(copy_to_parallel_region(self.bias, self.group), self.compute_dtype)
        y = reduce_from_parallel_region(partial, self.group)
        return y if self.bias is None else y + _cast(self.bias, self.compute_dtype)


class TensorParallelMLP(nn.Module):
    """GELU(x W1^T + b1) W2^T + b2 with fc1 column parallel and fc2 row parallel."""

    def __init__(
        self,
        fc1: ColumnParallelLinear,
        fc2: RowParallelLinear,
        group=None,
        sequence_parallel: bool = False,
        norm: nn.LayerNorm | None = None,
        dropout: float = 0.0,
        compute_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.fc1 = fc1
        self.fc2 = fc2
        self.norm = norm
        self.dropout = dropout
        self.compute_dtype = fc1.compute_dtype = fc2.compute_dtype = compute_dtype

    @classmethod
    def from_dense(
        cls,
        fc1: nn.Linear,
        fc2: nn.Linear,
        group=None,
        sequence_parallel: bool = False,
        norm: nn.LayerNorm | None = None,
        dropout: float = 0.0,
        compute_dtype: torch.dtype | None = None,
    ) -> TensorParallelMLP:
        n = _size(group)
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc1.out_features = {fc1.out_features} must equal fc2.in_features = {fc2.in_features}")
        _check_divisible("ffn width (fc1.out_features = fc2.in_features)", fc1.out_features, n)
        column = ColumnParallelLinear.from_dense(fc1, group, gather_output=False, sequence_parallel=sequence_parallel)
        row = RowParallelLinear.from_dense(fc2, group, input_is_parallel=True, sequence_parallel=sequence_parallel)
        return cls(column, row, group, sequence_parallel, None if norm is None else copy.deepcopy(norm), dropout, compute_dtype)

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        if norm is None or not self.sequence_parallel:
            return x if norm is None else norm(x)
        weight = None if norm.weight is None else copy_to_parallel_region(norm.weight, self.group)
        bias = None if norm.bias is None else copy_to_parallel_region(norm.bias, self.group)
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)

    def _slice_of_dense_mask(self, local: torch.Tensor, dim: int | None) -> torch.Tensor:
        """This rank's part of the mask torch's dropout would draw over the dense tensor (noise =
        empty_like(dense).bernoulli_(1 - p).div_(1 - p)): the dense tensor's shape is ``local``'s
        with ``dim`` n times longer (None: ``local`` is whole), and every member draws the whole
        mask from a generator in the same state, so they agree and the block equals the dense one
        with dropout. Drawing on the shard's shape instead would give every shard the same mask."""
        n, r = _size(self.group), _rank(self.group)
        shape = list(local.shape)
        if dim is not None:
            shape[dim] *= n
        noise = torch.empty(shape, dtype=local.dtype, device=local.device).bernoulli_(1 - self.dropout)
        noise.div_(1 - self.dropout)
        return noise if dim is None else noise.narrow(dim, r * local.shape[dim], local.shape[dim])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is not None and self.norm is not None:
            raise NotImplementedError("compute_dtype with a LayerNorm before the MLP is not implemented")
        x = _cast(x, self.compute_dtype)
        hidden = F.gelu(self.fc1(self._normed(x)), approximate="none")
        if self.dropout:  # the sharded region: this rank's columns of the dense hidden mask
            hidden = hidden * self._slice_of_dense_mask(hidden, -1)
        y = self.fc2(hidden)
        if self.dropout:  # the replicated region (a sequence shard of it under sequence parallelism)
            y = y * self._slice_of_dense_mask(y, SEQUENCE_DIM if self.sequence_parallel else None)
        return y
