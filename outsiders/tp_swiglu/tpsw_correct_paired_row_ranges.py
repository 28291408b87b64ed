"""Correct: the fused gate/up weight keeps the same row range of the gate half and of the up half, [gate_r | up_r], and the down projection is row parallel with its bias added once.

verdict: pass
capability: tp_swiglu

Written from the contract alone. ``from_dense`` reads f from the fused layer (2f rows), refuses an
odd row count and an f the group size does not divide with a ValueError naming ``ffn``, its size and
n, before any communication, and then views the fused weight (and bias) as [2, f, h] and keeps
[:, r f/n : (r+1) f/n] of both halves, flattened back to [gate_r | up_r]; ``down`` keeps columns
[r f/n, (r+1) f/n) and its whole bias. The forward splits the local projection in two halves and
computes down(silu(a) * b) on this member's f/n hidden units; the product is element-wise, so the
hidden units of different members never meet before the row layer's reduction. Communication is a
pair of autograd Functions over torch.distributed: a scatter/gather pair written with
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` on the sequence dimension moved to the
front (sequence parallelism), or identity / all-reduce entering and all-reduce / identity leaving
(replicated input). Under sequence parallelism the down bias is added to a sequence shard, so its
gradient is summed over the group by an identity-forward / all-reduce-backward function and equals
the dense gradient over the whole sequence on every member.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _size_rank(group):
    return dist.get_world_size(group), dist.get_rank(group)


def _allreduce(t, group):
    t = t.clone().contiguous()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _seq_all_gather(t, group):
    n = dist.get_world_size(group)
    if n == 1:
        return t
    front = t.transpose(0, -2).contiguous()
    out = front.new_empty((n * front.shape[0],) + tuple(front.shape[1:]))
    dist.all_gather_into_tensor(out, front, group=group)
    return out.transpose(0, -2).contiguous()


def _seq_reduce_scatter(t, group):
    n = dist.get_world_size(group)
    if n == 1:
        return t
    front = t.transpose(0, -2).contiguous()
    out = front.new_empty((front.shape[0] // n,) + tuple(front.shape[1:]))
    dist.reduce_scatter_tensor(out, front, group=group)
    return out.transpose(0, -2).contiguous()


class _ToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sp):
        ctx.group, ctx.sp = group, sp
        return _seq_all_gather(x, group) if sp else x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.sp:
            return _seq_reduce_scatter(g, ctx.group), None, None
        return _allreduce(g, ctx.group), None, None


class _FromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, sp):
        ctx.group, ctx.sp = group, sp
        return _seq_reduce_scatter(y, group) if sp else _allreduce(y, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.sp:
            return _seq_all_gather(g, ctx.group), None, None
        return g, None, None


class _GradSummed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, group):
        ctx.group = group
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        return _allreduce(g, ctx.group), None


class _LocalLinear(nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone().contiguous())
        self.out_features, self.in_features = self.weight.shape


class TensorParallelSwiGLU(nn.Module):
    def __init__(self, gate_up, down, ffn, group, sequence_parallel):
        super().__init__()
        self.gate_up = gate_up
        self.down = down
        self.ffn = ffn
        self.group = group
        self.sequence_parallel = sequence_parallel

    @classmethod
    def from_dense(cls, gate_up, down, group=None, sequence_parallel=False):
        rows, h = gate_up.weight.shape
        if rows % 2:
            raise ValueError(f"gate_up has {rows} rows; it must hold 2 * ffn rows")
        f = rows // 2
        if down.weight.shape[1] != f:
            raise ValueError(f"down has in_features={down.weight.shape[1]}, expected ffn={f}")
        n, r = _size_rank(group)
        if f % n:
            raise ValueError(f"ffn={f} is not divisible by the group size n={n}")
        k = f // n
        w = gate_up.weight.detach().reshape(2, f, h)[:, r * k:(r + 1) * k].reshape(2 * k, h)
        b = None
        if gate_up.bias is not None:
            b = gate_up.bias.detach().reshape(2, f)[:, r * k:(r + 1) * k].reshape(2 * k)
        col = _LocalLinear(w, b)
        row = _LocalLinear(down.weight.detach()[:, r * k:(r + 1) * k],
                           None if down.bias is None else down.bias.detach())
        return cls(col, row, f, group, bool(sequence_parallel))

    def forward(self, x):
        x = _ToParallel.apply(x, self.group, self.sequence_parallel)
        a, b = F.linear(x, self.gate_up.weight, self.gate_up.bias).chunk(2, dim=-1)
        hidden = F.silu(a) * b
        y = _FromParallel.apply(F.linear(hidden, self.down.weight), self.group,
                                self.sequence_parallel)
        if self.down.bias is not None:
            bias = self.down.bias
            if self.sequence_parallel:
                bias = _GradSummed.apply(bias, self.group)
            y = y + bias
        return y
