"""Correct: ring attention as a custom autograd.Function, online softmax with log-sum-exp, backward ring carrying dK/dV home.
verdict: pass
capability: context_parallel

Forward keeps this rank's queries and passes one stacked K/V block to the next rank n-1 times,
folding each block into running row maxima, row sums and accumulators; it saves the per-row
log-sum-exp. Backward recomputes each block's probabilities from the log-sum-exp (as
FlashAttention-2 does), passes K/V around the same ring again, and lets each block's dK/dV
accumulator travel with it, one last hop bringing it back to its owner.
"""
import math

import torch
import torch.distributed as dist


def _chunk_positions(seq_len, n, r):
    chunks = torch.tensor_split(torch.arange(seq_len), 2 * n)
    return torch.cat([chunks[r], chunks[2 * n - 1 - r]])


class _Ring:
    def __init__(self, group):
        self.group = group if group is not None else dist.group.WORLD
        self.n = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.n)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.n)

    def shift(self, tensor, recv_shape):
        """Send ``tensor`` to the next rank, return what the previous rank sent."""
        out = torch.empty(recv_shape, dtype=tensor.dtype, device=tensor.device)
        reqs = [dist.isend(tensor.contiguous(), dst=self.next, group=self.group),
                dist.irecv(out, src=self.prev, group=self.group)]
        for req in reqs:
            req.wait()
        return out


def _block_scores(q, k, scale, q_pos, k_pos, causal):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        s = s.masked_fill(~allowed, float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_len, causal, group):
        ring = _Ring(group)
        n, me = ring.n, ring.rank
        heads, rows, d = q.shape
        scale = 1.0 / math.sqrt(d)
        positions = [_chunk_positions(seq_len, n, r).to(q.device) for r in range(n)]
        q_pos = positions[me]

        m = torch.full((heads, rows, 1), float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros((heads, rows, 1), dtype=q.dtype, device=q.device)
        acc = torch.zeros_like(q)

        kv = torch.stack([k, v])
        for step in range(n):
            src = (me - step) % n
            kb, vb = kv[0], kv[1]
            s = _block_scores(q, kb, scale, q_pos, positions[src], causal)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - shift)
            alpha = torch.exp(m - shift)
            l = l * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, vb)
            m = m_new
            if step < n - 1:
                nxt = (src - 1) % n
                kv = ring.shift(kv, (2, heads, positions[nxt].numel(), d))

        out = acc / l
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seq_len, ctx.causal, ctx.group = seq_len, causal, group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        n, me = ring.n, ring.rank
        heads, rows, d = q.shape
        scale = 1.0 / math.sqrt(d)
        positions = [_chunk_positions(ctx.seq_len, n, r).to(q.device) for r in range(n)]
        q_pos = positions[me]
        grad_out = grad_out.contiguous()

        delta = (grad_out * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)
        for step in range(n):
            src = (me - step) % n
            kb, vb = kv[0], kv[1]
            s = _block_scores(q, kb, scale, q_pos, positions[src], ctx.causal)
            p = torch.exp(s - lse)
            dv_b = torch.matmul(p.transpose(-1, -2), grad_out)
            dp = torch.matmul(grad_out, vb.transpose(-1, -2))
            ds = p * (dp - delta)
            dq = dq + torch.matmul(ds, kb) * scale
            dk_b = torch.matmul(ds.transpose(-1, -2), q) * scale
            dkv = dkv + torch.stack([dk_b, dv_b])
            nxt = (src - 1) % n
            shape = (2, heads, positions[nxt].numel(), d)
            if step < n - 1:
                kv = ring.shift(kv, shape)
            if n > 1:
                dkv = ring.shift(dkv, shape)
        return dq, dkv[0], dkv[1], None, None, None


def context_parallel_attention(q, k, v, seq_len, causal=False, group=None):
    """This rank's rows of attention over the whole sequence (rank i holds chunks i and 2n-1-i of 2n):
    ring attention, K/V blocks passed around the group, combined by the online-softmax rule."""
    return _RingAttention.apply(q, k, v, seq_len, causal, group)


__all__ = ["context_parallel_attention"]
