"""Context parallelism: ring attention over a sequence sharded across the ranks of a group (Liu,
Zaharia and Abbeel, "Ring Attention with Blockwise Transformers", 2023), with the load-balanced
causal layout of Striped Attention / Llama 3: the sequence is cut into 2n chunks
(torch.tensor_split), and group rank i holds chunks i and 2n-1-i.

``context_parallel_attention(q, k, v, seq_len, causal=False, group=None)``: q, k, v [H, s_i, d] are
this rank's rows; the result is this rank's rows of softmax(Q K^T / sqrt(d) + M) V. Each rank keeps
its queries and passes its K/V block around the ring n-1 times (send to the next group rank,
receive from the previous one); each block is folded into running row maxima m, sums l and
accumulators a by the online-softmax rule

    m' = max(m, rowmax S),  l' = l e^{m - m'} + rowsum e^{S - m'},  a' = a e^{m - m'} + e^{S - m'} V,

and O = a / l. The causal mask compares global positions (a block's positions follow from its
owner's group rank and seq_len). Backward is autograd through the same computation: each ring step
is an autograd Function whose backward sends the block's gradient back to the rank it came from,
so dK and dV travel home along the reversed ring (n-1 blocks again).

Point-to-point only (dist.isend / dist.irecv); never imports reference/.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _chunk_rows(seq_len: int, n: int, rank: int) -> torch.Tensor:
    """Global positions of group rank ``rank``'s rows: chunks rank and 2n-1-rank of 2n."""
    chunks = 2 * n
    base, extra = divmod(seq_len, chunks)
    starts = [c * base + min(c, extra) for c in range(chunks + 1)]
    first, second = rank, chunks - 1 - rank
    return torch.cat([torch.arange(starts[first], starts[first + 1]), torch.arange(starts[second], starts[second + 1])])


def _exchange(send: torch.Tensor, to: int, receive: torch.Tensor, source: int, group) -> torch.Tensor:
    """Send ``send`` to group rank ``to`` while receiving ``receive`` from group rank ``source``."""
    to_global = dist.get_global_rank(group, to) if group is not None else to
    from_global = dist.get_global_rank(group, source) if group is not None else source
    works = [dist.irecv(receive, src=from_global, group=group), dist.isend(send.contiguous(), dst=to_global, group=group)]
    for work in works:
        work.wait()
    return receive


class _PassAlongRing(torch.autograd.Function):
    """Forward: send this block to the next rank, receive the previous rank's (of ``shape``).
    Backward: the gradient goes back the way the block came."""

    @staticmethod
    def forward(ctx, block, shape, group):
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, ctx.shape = group, block.shape
        return _exchange(block, (rank + 1) % n, block.new_empty(shape), (rank - 1) % n, group)

    @staticmethod
    def backward(ctx, grad):
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        back = _exchange(grad, (rank - 1) % n, grad.new_empty(ctx.shape), (rank + 1) % n, ctx.group)
        return back, None, None


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, causal: bool = False, group=None
) -> torch.Tensor:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = _chunk_rows(seq_len, n, rank)
    if q.shape[-2] != len(mine):
        raise ValueError(
            f"group rank {rank} of {n} holds {len(mine)} of the {seq_len} positions (chunks {rank} and "
            f"{2 * n - 1 - rank} of {2 * n}), but q has {q.shape[-2]} rows"
        )
    scale = 1.0 / math.sqrt(q.shape[-1])
    rows = (*q.shape[:-1], 1)
    running_max = q.new_full(rows, float("-inf"))
    total = q.new_zeros(rows)
    accumulated = torch.zeros_like(q)
    block, owner = torch.stack([k, v]), rank
    for step in range(n):
        if step:
            owner = (owner - 1) % n
            incoming = (2, *k.shape[:-2], len(_chunk_rows(seq_len, n, owner)), k.shape[-1])
            block = _PassAlongRing.apply(block, incoming, group)
        keys, values = block[0], block[1]
        scores = q @ keys.transpose(-1, -2) * scale
        if causal:
            future = _chunk_rows(seq_len, n, owner)[None, :] > mine[:, None]
            scores = scores.masked_fill(future.to(scores.device), float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True).detach())
        shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        rescale = torch.exp(running_max - shift)
        weights = torch.exp(scores - shift)
        total = total * rescale + weights.sum(dim=-1, keepdim=True)
        accumulated = accumulated * rescale + weights @ values
        running_max = new_max
    return accumulated / total
