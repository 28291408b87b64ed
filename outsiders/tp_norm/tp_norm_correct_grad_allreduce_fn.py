"""Correct: a pre-norm Megatron MLP whose LayerNorm runs in the sequence-parallel region behind an identity-forward, all-reduce-backward function on its weight and bias.

verdict: pass
capability: tp_norm

Written from the contract alone, Megatron-style: four autograd Functions carry the conjugate
communication pairs (f: identity / all-reduce, g: all-reduce / identity, and with sequence
parallelism f: all-gather of dim -2 / reduce-scatter, g: reduce-scatter of dim -2 / all-gather),
built on ``dist.all_reduce``, ``dist.all_gather_into_tensor`` and ``dist.reduce_scatter_tensor``
after moving the split dimension to the front, so they run on gloo (CPU) and NCCL alike.
``from_dense`` checks divisibility before it touches the group and copies this rank's contiguous
rows of fc1 (and of its bias) and columns of fc2, with fc2's bias whole; the row layer adds its bias
once, after the reduction. The LayerNorm is copied whole onto every member as ``.norm``. Without
sequence parallelism it sees the replicated input and f's all-reduce hands it the full gradient,
so its parameter gradients are already the dense ones and are not reduced again. With sequence
parallelism it normalises only this rank's shard, so its weight and bias (like fc2's bias, which is
added to a reduce-scattered shard) enter the graph through the same identity-forward,
all-reduce(SUM)-backward function as f: the gradient that reaches the leaf is the sum of the
per-shard partial gradients, i.e. the dense one over the whole sequence, and since every member
receives the same all-reduced tensor it is bitwise identical on all of them.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# --------------------------------------------------------------------------- helpers

def _group_size_rank(group):
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(t, group):
    t = t.contiguous()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _all_gather_dim(t, dim, group):
    """Concatenate every member's ``t`` along ``dim`` (member order)."""
    n = dist.get_world_size(group)
    if n == 1:
        return t.contiguous()
    front = t.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] * n,) + tuple(front.shape[1:]),
                      dtype=front.dtype, device=front.device)
    dist.all_gather_into_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_dim(t, dim, group):
    """Sum ``t`` over the group and keep this member's contiguous chunk of ``dim``."""
    n = dist.get_world_size(group)
    if n == 1:
        return t.contiguous()
    front = t.movedim(dim, 0).contiguous()
    if front.shape[0] % n:
        raise ValueError(f"dimension of size {front.shape[0]} does not split over {n} ranks")
    out = torch.empty((front.shape[0] // n,) + tuple(front.shape[1:]),
                      dtype=front.dtype, device=front.device)
    dist.reduce_scatter_tensor(out, front, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim).contiguous()


def _split_dim(t, dim, group):
    n, r = _group_size_rank(group)
    if n == 1:
        return t
    size = t.shape[dim]
    if size % n:
        raise ValueError(f"dimension of size {size} does not split over {n} ranks")
    k = size // n
    return t.narrow(dim, r * k, k).contiguous()


# --------------------------------------------------------------------------- autograd functions

class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """f under sequence parallelism: all-gather dim -2 forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim(x, -2, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim(grad, -2, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """g under sequence parallelism: reduce-scatter dim -2 forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim(x, -2, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, -2, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    """Column layer's gather_output: all-gather the last dim, backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_dim(grad, -1, ctx.group), None


class _ScatterLastDim(torch.autograd.Function):
    """Row layer's input_is_parallel=False: keep this rank's slice, backward all-gathers it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, -1, ctx.group), None


def _param(t):
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=True)


# --------------------------------------------------------------------------- layers

class ColumnParallelLinear(nn.Module):
    def __init__(self, weight, bias, group, gather_output, in_features, out_features):
        super().__init__()
        self.group = group
        self.gather_output = gather_output
        self.in_features = in_features
        self.out_features = out_features
        self.weight = weight
        self.bias = bias
        # inside the MLP the f before fc1 is done by the block (plain or sequence-parallel)
        self._copy_input = True

    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        n, r = _group_size_rank(group)
        out_f, in_f = linear.weight.shape
        if out_f % n:
            raise ValueError(f"out_features={out_f} is not divisible by the group size n={n}")
        k = out_f // n
        weight = _param(linear.weight[r * k:(r + 1) * k])
        bias = None if linear.bias is None else _param(linear.bias[r * k:(r + 1) * k])
        return cls(weight, bias, group, gather_output, in_f, out_f)

    def forward(self, x):
        if self._copy_input:
            x = _CopyToRegion.apply(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = _GatherLastDim.apply(y, self.group)
        return y


class RowParallelLinear(nn.Module):
    def __init__(self, weight, bias, group, input_is_parallel, in_features, out_features):
        super().__init__()
        self.group = group
        self.input_is_parallel = input_is_parallel
        self.in_features = in_features
        self.out_features = out_features
        self.weight = weight
        self.bias = bias
        # set by the MLP under sequence parallelism: g becomes a reduce-scatter of dim -2
        self._sequence_parallel = False

    @classmethod
    def from_dense(cls, linear, group=None, input_is_parallel=True):
        n, r = _group_size_rank(group)
        out_f, in_f = linear.weight.shape
        if in_f % n:
            raise ValueError(f"in_features={in_f} is not divisible by the group size n={n}")
        k = in_f // n
        weight = _param(linear.weight[:, r * k:(r + 1) * k])
        bias = None if linear.bias is None else _param(linear.bias)
        return cls(weight, bias, group, input_is_parallel, in_f, out_f)

    def forward(self, x):
        if not self.input_is_parallel:
            x = _ScatterLastDim.apply(x, self.group)
        partial = F.linear(x, self.weight)
        if self._sequence_parallel:
            y = _ReduceScatterToSequence.apply(partial, self.group)
            if self.bias is not None:
                # added on a sequence shard: its gradient is partial, sum it over the group
                y = y + _CopyToRegion.apply(self.bias, self.group)
        else:
            y = _ReduceFromRegion.apply(partial, self.group)
            if self.bias is not None:
                y = y + self.bias
        return y


class _RegionLayerNorm(nn.LayerNorm):
    """A whole LayerNorm; under sequence parallelism its parameter gradients are summed over the group."""

    group = None
    sequence_parallel = False

    def forward(self, x):
        weight, bias = self.weight, self.bias
        if self.sequence_parallel:
            if weight is not None:
                weight = _CopyToRegion.apply(weight, self.group)
            if bias is not None:
                bias = _CopyToRegion.apply(bias, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def _copy_norm(ln, group, sequence_parallel):
    has_weight = getattr(ln, "weight", None) is not None
    has_bias = getattr(ln, "bias", None) is not None
    ref = ln.weight if has_weight else None
    kwargs = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
    norm = _RegionLayerNorm(tuple(ln.normalized_shape), eps=ln.eps,
                            elementwise_affine=has_weight, bias=has_bias, **kwargs)
    with torch.no_grad():
        if has_weight:
            norm.weight.copy_(ln.weight.detach())
        if has_bias:
            norm.bias.copy_(ln.bias.detach())
    norm.group = group
    norm.sequence_parallel = sequence_parallel
    return norm


class TensorParallelMLP(nn.Module):
    def __init__(self, fc1, fc2, group, sequence_parallel, norm):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.norm = norm
        self.fc1 = fc1
        self.fc2 = fc2

    @classmethod
    def from_dense(cls, fc1, fc2, group=None, sequence_parallel=False, norm=None):
        n, _ = _group_size_rank(group)
        ffn = fc1.weight.shape[0]
        if ffn % n:
            raise ValueError(f"ffn={ffn} (the ffn width of fc1) is not divisible by the group size n={n}")
        col = ColumnParallelLinear.from_dense(fc1, group=group, gather_output=False)
        row = RowParallelLinear.from_dense(fc2, group=group, input_is_parallel=True)
        col._copy_input = False
        row._sequence_parallel = bool(sequence_parallel)
        ln = None if norm is None else _copy_norm(norm, group, bool(sequence_parallel))
        return cls(col, row, group, bool(sequence_parallel), ln)

    def forward(self, x):
        if self.norm is not None:
            x = self.norm(x)
        if self.sequence_parallel:
            x = _GatherFromSequence.apply(x, self.group)
        else:
            x = _CopyToRegion.apply(x, self.group)
        h = F.gelu(self.fc1(x))
        return self.fc2(h)
