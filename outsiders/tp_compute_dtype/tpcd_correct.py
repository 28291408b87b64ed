"""Correct: a Megatron MLP whose float32 master parameters are cast to the compute dtype where used, with the sequence-parallel row bias gradient all-reduced in float32 (the bias is cast after f).

verdict: pass
capability: tp_compute_dtype

Written from the contract alone. The parameters are nn.Parameters of the dense layers' dtype holding
this member's shard (the row layer's bias whole); with ``compute_dtype=d`` each forward casts the
input and every parameter to d at the point of use (``w.to(d)``), so autograd returns every
gradient to ``.grad`` in the parameter's own dtype. Megatron's f and g are autograd Functions over
torch.distributed collectives: f identity / all-reduce and g all-reduce / identity; with sequence
parallelism f is an all-gather of dim -2 / reduce-scatter and g a reduce-scatter of dim -2 /
all-gather (the reduce-scatter is an all-reduce followed by taking this member's contiguous chunk,
which gloo can run). The row layer's bias is added once, after g; under sequence parallelism it first
passes through f (identity / all-reduce) in float32 and only then is cast to d, so the per-member
partial sums of its gradient are summed across the group in float32, not in d.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _n(group):
    return dist.get_world_size(group)


def _r(group):
    return dist.get_rank(group)


def _all_reduce(t, group):
    t = t.contiguous().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _gather(t, dim, group):
    n = _n(group)
    src = t.movedim(dim, 0).contiguous()
    out = torch.empty((n * src.shape[0],) + tuple(src.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, src, group=group)
    return out.movedim(0, dim).contiguous()


def _chunk(t, dim, group):
    return t.chunk(_n(group), dim=dim)[_r(group)].contiguous()


def _reduce_scatter(t, dim, group):
    return _chunk(_all_reduce(t, group), dim, group)


class _CopyToGroup(torch.autograd.Function):  # f: identity / all-reduce
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):  # g: all-reduce / identity
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromGroup(torch.autograd.Function):  # all-gather dim / take own chunk
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _chunk(g, ctx.dim, ctx.group), None, None


class _ScatterToGroup(torch.autograd.Function):  # take own chunk / all-gather dim
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _chunk(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.group), None, None


class _SeqGather(torch.autograd.Function):  # SP f: all-gather dim -2 / reduce-scatter dim -2
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -2, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, -2, ctx.group), None


class _SeqReduceScatter(torch.autograd.Function):  # SP g: reduce-scatter dim -2 / all-gather dim -2
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, -2, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, -2, ctx.group), None


def _split_size(size, n, name):
    if size % n:
        raise ValueError(f"{name} = {size} is not divisible by the group size n = {n}")
    return size // n


def _param(t):
    return nn.Parameter(t.detach().clone().contiguous())


def _cast(t, dtype):
    return t if t is None or dtype is None else t.to(dtype)


class ColumnParallelLinear(nn.Module):
    def __init__(self, weight, bias, group, gather_output, compute_dtype=None):
        super().__init__()
        self.weight, self.bias = _param(weight), None if bias is None else _param(bias)
        self.group, self.gather_output, self.compute_dtype = group, gather_output, compute_dtype
        self.sequence_parallel = False

    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False, compute_dtype=None):
        n, r = _n(group), _r(group)
        k = _split_size(linear.out_features, n, "out_features")
        b = None if linear.bias is None else linear.bias[r * k:(r + 1) * k]
        return cls(linear.weight[r * k:(r + 1) * k], b, group, gather_output, compute_dtype)

    def forward(self, x):
        d = self.compute_dtype
        x = _cast(x, d)
        if self.sequence_parallel:
            x = _SeqGather.apply(x, self.group)
        else:
            x = _CopyToGroup.apply(x, self.group)
        y = F.linear(x, _cast(self.weight, d), _cast(self.bias, d))
        return _GatherFromGroup.apply(y, -1, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    def __init__(self, weight, bias, group, input_is_parallel, compute_dtype=None):
        super().__init__()
        self.weight, self.bias = _param(weight), None if bias is None else _param(bias)
        self.group, self.input_is_parallel, self.compute_dtype = group, input_is_parallel, compute_dtype
        self.sequence_parallel = False

    @classmethod
    def from_dense(cls, linear, group=None, input_is_parallel=True, compute_dtype=None):
        n, r = _n(group), _r(group)
        k = _split_size(linear.in_features, n, "in_features")
        return cls(linear.weight[:, r * k:(r + 1) * k], linear.bias, group, input_is_parallel, compute_dtype)

    def forward(self, x):
        d = self.compute_dtype
        x = _cast(x, d)
        if not self.input_is_parallel:
            x = _ScatterToGroup.apply(x, -1, self.group)
        y = F.linear(x, _cast(self.weight, d))
        if self.sequence_parallel:
            y = _SeqReduceScatter.apply(y, self.group)
        else:
            y = _ReduceFromGroup.apply(y, self.group)
        if self.bias is None:
            return y
        b = self.bias
        if self.sequence_parallel:  # f on the master bias: its gradient is all-reduced in its own dtype
            b = _CopyToGroup.apply(b, self.group)
        return y + _cast(b, d)


class TensorParallelMLP(nn.Module):
    def __init__(self, fc1, fc2, group, sequence_parallel):
        super().__init__()
        self.fc1, self.fc2, self.group = fc1, fc2, group
        self.sequence_parallel = fc1.sequence_parallel = fc2.sequence_parallel = sequence_parallel

    @classmethod
    def from_dense(cls, fc1, fc2, group=None, sequence_parallel=False, norm=None, dropout=0.0,
                   compute_dtype=None):
        if norm is not None:
            raise NotImplementedError("norm is not implemented (capability tp_norm)")
        if dropout:
            raise NotImplementedError("dropout is not implemented (capability tp_dropout)")
        _split_size(fc1.out_features, _n(group), "ffn")
        c = ColumnParallelLinear.from_dense(fc1, group, gather_output=False, compute_dtype=compute_dtype)
        r = RowParallelLinear.from_dense(fc2, group, input_is_parallel=True, compute_dtype=compute_dtype)
        return cls(c, r, group, sequence_parallel)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))
