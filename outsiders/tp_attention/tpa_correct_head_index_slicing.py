"""Correct: the fused QKV rows are picked head by head from an index table built for either layout, and grouped-query attention maps local query head j to local key/value head j // (H / H_kv).

verdict: pass
capability: tp_attention

Written from the contract alone. ``from_dense`` validates before touching the group (the layout
name, H a multiple of H_kv, the fused rows a multiple of H + 2 H_kv, n dividing H_kv) and then
describes the fused weight as a list of (kind, head) row blocks of width d in the checkpoint's own
order: [Q_0..Q_{H-1} | K_0.. | V_0..] for "concatenated", and for "grouped" each key/value group g
as its H / H_kv query heads, then K_g, then V_g. A member keeps exactly the blocks whose head falls
in its range (query heads [r H/n, (r+1) H/n), key/value heads [r H_kv/n, (r+1) H_kv/n)) in the order
they appear, which is the same layout for its own head counts: three pieces for "concatenated", one
contiguous chunk for "grouped". The rows are gathered with ``index_select`` on the weight and on the
bias. The forward un-fuses the local projection with the matching local description (a reshape to
[.., H_kv/n, H/H_kv + 2, d] for "grouped", three slices for "concatenated"), expands the key and value
heads with ``repeat_interleave`` so local query head j reads local key/value head j // (H/H_kv), and
runs causal softmax attention over the whole sequence with scale 1/sqrt(d). Communication is two
autograd Functions with conjugate forward/backward pairs over torch.distributed: entering the
parallel region is identity / all-reduce (all-gather of dim -2 / reduce-scatter under sequence
parallelism), leaving it is all-reduce / identity (reduce-scatter of dim -2 / all-gather). The
reduce-scatter is an all-reduce followed by keeping this member's contiguous chunk, so it runs on
any backend. The output projection is row parallel: columns [r H d/n, (r+1) H d/n) and the whole
bias, added once after the reduction; under sequence parallelism it is added to the sequence shard,
so it enters through an identity-forward / all-reduce-backward function and its gradient is the
dense one over the whole sequence, bitwise equal on every member.
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# --------------------------------------------------------------------------- communication

def _members(group):
    return dist.get_world_size(group), dist.get_rank(group)


def _sum_over_group(t, group):
    t = t.contiguous().clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _gather_seq(t, group):
    n = dist.get_world_size(group)
    if n == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=-2)


def _reduce_scatter_seq(t, group):
    n, r = _members(group)
    if n == 1:
        return t
    total = _sum_over_group(t, group)
    k = total.shape[-2] // n
    return total.narrow(-2, r * k, k).contiguous()


class _EnterRegion(torch.autograd.Function):
    """Replicated (or sequence-sharded) input -> input of the column layer on every member."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel):
        ctx.group, ctx.sp = group, sequence_parallel
        if sequence_parallel:
            return _gather_seq(x, group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sp:
            return _reduce_scatter_seq(grad, ctx.group), None, None
        return _sum_over_group(grad, ctx.group), None, None


class _LeaveRegion(torch.autograd.Function):
    """Partial sums of the row layer -> replicated (or sequence-sharded) output."""

    @staticmethod
    def forward(ctx, partial, group, sequence_parallel):
        ctx.group, ctx.sp = group, sequence_parallel
        if sequence_parallel:
            return _reduce_scatter_seq(partial, group)
        return _sum_over_group(partial, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sp:
            return _gather_seq(grad.contiguous(), ctx.group), None, None
        return grad, None, None


class _SumGrad(torch.autograd.Function):
    """Identity forward; the gradient is summed over the group (a whole parameter used on a shard)."""

    @staticmethod
    def forward(ctx, p, group):
        ctx.group = group
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        return _sum_over_group(grad, ctx.group), None


# --------------------------------------------------------------------------- shards

class _Shard(nn.Module):
    """A linear layer's local weight and bias (``bias`` None when the dense layer has none)."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone().contiguous())
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(bias.detach().clone().contiguous())
        self.out_features, self.in_features = self.weight.shape


def _fused_blocks(layout, num_heads, num_kv_heads):
    """The fused rows as (kind, head) blocks of d rows each, in the checkpoint's order."""
    if layout == "concatenated":
        return ([("q", i) for i in range(num_heads)]
                + [("k", j) for j in range(num_kv_heads)]
                + [("v", j) for j in range(num_kv_heads)])
    per_group = num_heads // num_kv_heads
    blocks = []
    for g in range(num_kv_heads):
        blocks += [("q", g * per_group + t) for t in range(per_group)]
        blocks += [("k", g), ("v", g)]
    return blocks


# --------------------------------------------------------------------------- the layer

class TensorParallelAttention(nn.Module):
    def __init__(self, qkv, out, num_heads, num_kv_heads, head_dim, group, sequence_parallel,
                 qkv_layout):
        super().__init__()
        self.qkv = qkv
        self.out = out
        self.num_heads = num_heads            # local
        self.num_kv_heads = num_kv_heads      # local
        self.head_dim = head_dim
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.qkv_layout = qkv_layout

    @classmethod
    def from_dense(cls, qkv, out, num_heads, num_kv_heads, group=None, sequence_parallel=False,
                   qkv_layout="concatenated"):
        if qkv_layout not in ("concatenated", "grouped"):
            raise ValueError(f"qkv_layout={qkv_layout!r} is neither 'concatenated' nor 'grouped'")
        H, H_kv = int(num_heads), int(num_kv_heads)
        if H <= 0 or H_kv <= 0 or H % H_kv:
            raise ValueError(f"num_heads={H} is not a multiple of num_kv_heads={H_kv}")
        rows = qkv.weight.shape[0]
        if rows % (H + 2 * H_kv):
            raise ValueError(f"qkv has {rows} rows, not a multiple of num_heads + 2 num_kv_heads"
                             f" = {H + 2 * H_kv}")
        d = rows // (H + 2 * H_kv)
        if out.weight.shape[1] != H * d:
            raise ValueError(f"out has in_features={out.weight.shape[1]}, expected"
                             f" num_heads * head_dim = {H * d}")
        n, r = _members(group)
        if H_kv % n:
            raise ValueError(f"num_kv_heads={H_kv} is not divisible by the group size n={n}")

        hq, hkv = H // n, H_kv // n
        q_lo, kv_lo = r * hq, r * hkv
        keep = []
        for b, (kind, head) in enumerate(_fused_blocks(qkv_layout, H, H_kv)):
            lo, cnt = (q_lo, hq) if kind == "q" else (kv_lo, hkv)
            if lo <= head < lo + cnt:
                keep.extend(range(b * d, (b + 1) * d))
        index = torch.tensor(keep, dtype=torch.long, device=qkv.weight.device)
        w = qkv.weight.detach().index_select(0, index)
        b = None if qkv.bias is None else qkv.bias.detach().index_select(0, index)
        qkv_shard = _Shard(w, b)

        cols = slice(r * hq * d, (r + 1) * hq * d)
        out_shard = _Shard(out.weight.detach()[:, cols],
                           None if out.bias is None else out.bias.detach())
        return cls(qkv_shard, out_shard, hq, hkv, d, group, bool(sequence_parallel), qkv_layout)

    def _split_heads(self, y):
        """[B, S, local rows] -> q [B, hq, S, d], k and v [B, hkv, S, d]."""
        B, S, _ = y.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_layout == "grouped":
            y = y.reshape(B, S, hkv, hq // hkv + 2, d)
            q = y[:, :, :, :-2, :].reshape(B, S, hq, d)
            k = y[:, :, :, -2, :]
            v = y[:, :, :, -1, :]
        else:
            q = y[..., : hq * d].reshape(B, S, hq, d)
            k = y[..., hq * d: (hq + hkv) * d].reshape(B, S, hkv, d)
            v = y[..., (hq + hkv) * d:].reshape(B, S, hkv, d)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x):
        x = _EnterRegion.apply(x, self.group, self.sequence_parallel)
        lead = x.shape[:-2]
        y = F.linear(x, self.qkv.weight, self.qkv.bias)
        q, k, v = self._split_heads(y.reshape((-1,) + tuple(y.shape[-2:])))
        per_kv = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(per_kv, dim=1)
        v = v.repeat_interleave(per_kv, dim=1)

        S = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        future = torch.ones(S, S, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), v)          # [B, hq, S, d]
        o = o.transpose(1, 2).reshape(tuple(lead) + (S, self.num_heads * self.head_dim))

        partial = F.linear(o, self.out.weight)
        y = _LeaveRegion.apply(partial, self.group, self.sequence_parallel)
        if self.out.bias is not None:
            bias = self.out.bias
            if self.sequence_parallel:
                bias = _SumGrad.apply(bias, self.group)
            y = y + bias
        return y
