"""Correct: a Megatron MLP with both dropouts, each mask drawn over the dense tensor from the default generator (hidden first) and sliced to this member's part.

verdict: pass
capability: tp_dropout

Written from the contract alone. Megatron's f and g are autograd Functions over torch.distributed
collectives (f: identity / all-reduce, g: all-reduce / identity; with sequence parallelism f is an
all-gather of dim -2 / reduce-scatter and g a reduce-scatter of dim -2 / all-gather; on gloo the
reduce-scatter is an all-reduce followed by taking this member's chunk). ``from_dense`` checks
divisibility before any communication and copies this member's rows of fc1 (and its bias) and
columns of fc2, with fc2's bias whole, added once after the reduction (with sequence parallelism
through an identity / all-reduce function, so its gradient is the dense one on every member).
Dropout: after GELU every member draws ``torch.empty(dense hidden shape).bernoulli_(1-p).div_(1-p)``
in the activation's dtype from torch's default CPU generator and keeps its columns; after fc2's bias
it draws the dense output mask ``[..., seq, h]`` the same way and keeps it whole (or its contiguous
sequence shard). Every member draws the same numbers in the same order, so the block equals the
dense one under F.dropout's masks. p == 0 (or eval mode) draws nothing, like F.dropout.
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
    if n == 1:
        return t
    x = t.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] * n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(t, dim, group):
    n, r = _n(group), _r(group)
    if n == 1:
        return t
    x = t.movedim(dim, 0).contiguous()
    if dist.get_backend(group) == "nccl":
        out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group)
    else:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        out = x.chunk(n, dim=0)[r]
    return out.movedim(0, dim).contiguous()


def _own_chunk(t, dim, group):
    return t.chunk(_n(group), dim=dim)[_r(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):  # f: identity forward, all-reduce backward
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):  # g: all-reduce forward, identity backward
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromRegion(torch.autograd.Function):  # gather along dim forward, own chunk backward
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _own_chunk(g, ctx.dim, ctx.group), None, None


class _ScatterToRegion(torch.autograd.Function):  # own chunk forward, gather backward
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _own_chunk(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.group), None, None


class _SeqGather(torch.autograd.Function):  # SP f: all-gather dim -2 forward, reduce-scatter backward
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -2, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, -2, ctx.group), None


class _SeqReduceScatter(torch.autograd.Function):  # SP g: reduce-scatter dim -2 forward, all-gather backward
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, -2, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, -2, ctx.group), None


def _param(t):
    return None if t is None else nn.Parameter(t.detach().clone().contiguous())


def _check(size, name, n):
    if size % n != 0:
        raise ValueError(f"{name} = {size} is not divisible by the group size n = {n}")


class ColumnParallelLinear(nn.Module):
    def __init__(self, weight, bias, group, gather_output):
        super().__init__()
        self.weight, self.bias = _param(weight), _param(bias)
        self.group, self.gather_output = group, gather_output

    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        n, r = _n(group), _r(group)
        _check(linear.out_features, "out_features", n)
        k = linear.out_features // n
        b = None if linear.bias is None else linear.bias[r * k:(r + 1) * k]
        return cls(linear.weight[r * k:(r + 1) * k], b, group, gather_output)

    def forward(self, x):
        y = F.linear(_CopyToRegion.apply(x, self.group), self.weight, self.bias)
        return _GatherFromRegion.apply(y, -1, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    def __init__(self, weight, bias, group, input_is_parallel):
        super().__init__()
        self.weight, self.bias = _param(weight), _param(bias)
        self.group, self.input_is_parallel = group, input_is_parallel

    @classmethod
    def from_dense(cls, linear, group=None, input_is_parallel=True):
        n, r = _n(group), _r(group)
        _check(linear.in_features, "in_features", n)
        k = linear.in_features // n
        return cls(linear.weight[:, r * k:(r + 1) * k], linear.bias, group, input_is_parallel)

    def forward(self, x):
        if not self.input_is_parallel:
            x = _ScatterToRegion.apply(x, -1, self.group)
        y = _ReduceFromRegion.apply(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


def _dense_mask(shape, p, like):
    # exactly the noise F.dropout draws on the CPU: empty(dense).bernoulli_(1-p).div_(1-p)
    return torch.empty(shape, dtype=like.dtype).bernoulli_(1 - p).div_(1 - p).to(like.device)


class TensorParallelMLP(nn.Module):
    def __init__(self, fc1, fc2, group, sequence_parallel, dropout):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2
        self.group, self.sequence_parallel, self.dropout = group, sequence_parallel, float(dropout)

    @classmethod
    def from_dense(cls, fc1, fc2, group=None, sequence_parallel=False, norm=None, dropout=0.0):
        if norm is not None:
            raise NotImplementedError("norm: this implementation claims tp_dropout only")
        _check(fc1.out_features, "ffn", _n(group))
        return cls(ColumnParallelLinear.from_dense(fc1, group), RowParallelLinear.from_dense(fc2, group),
                   group, sequence_parallel, dropout)

    def _drop(self, t):
        return self.training and self.dropout > 0 and t.numel() > 0

    def forward(self, x):
        g, n, r, p = self.group, _n(self.group), _r(self.group), self.dropout
        x = _SeqGather.apply(x, g) if self.sequence_parallel else _CopyToRegion.apply(x, g)
        h = F.gelu(F.linear(x, self.fc1.weight, self.fc1.bias))
        if self._drop(h):
            k = h.shape[-1]
            mask = _dense_mask(tuple(h.shape[:-1]) + (k * n,), p, h)
            h = h * mask[..., r * k:(r + 1) * k]
        y = F.linear(h, self.fc2.weight)
        if self.sequence_parallel:
            y = _SeqReduceScatter.apply(y, g)
            if self.fc2.bias is not None:
                y = y + _CopyToRegion.apply(self.fc2.bias, g)
        else:
            y = _ReduceFromRegion.apply(y, g)
            if self.fc2.bias is not None:
                y = y + self.fc2.bias
        if self._drop(y):
            if self.sequence_parallel:
                s = y.shape[-2]
                mask = _dense_mask(tuple(y.shape[:-2]) + (s * n, y.shape[-1]), p, y)
                y = y * mask[..., r * s:(r + 1) * s, :]
            else:
                y = y * _dense_mask(y.shape, p, y)
        return y
