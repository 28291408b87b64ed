"""Single-process truth for context parallelism: scaled dot-product attention over the whole
sequence, and the load-balanced way a sequence is sharded across n ranks.

Attention (Vaswani et al. 2017): for heads h, queries Q [H, L, d], keys K and values V [H, L, d],

    O = softmax(Q K^T / sqrt(d) + M) V,

M = 0, or for causal attention M[p, t] = -inf where key position t > query position p.

Load-balanced causal sharding (Brandon et al., "Striped Attention" 2023; Llama 3's context
parallelism): the sequence is cut into 2n chunks, torch.tensor_split(range(L), 2n) (the first L %
2n chunks one longer), and rank i holds chunks i and 2n-1-i, in that order, so that under a
causal mask every rank gets a near-equal share of the work. Ring attention (Liu, Zaharia and
Abbeel, "Ring Attention with Blockwise Transformers", 2023) computes each rank's rows of O by
passing K/V blocks around the ring and combining partial results with the online-softmax rule
(Milakov and Gimelshein 2018): for running (m, l, a) and a new block with scores S and values V_b,

    m' = max(m, rowmax S),  l' = l e^{m - m'} + rowsum e^{S - m'},  a' = a e^{m - m'} + e^{S - m'} V_b,

and O = a / l at the end. The reference does not use that rule: it computes the dense O in
float64 and the gradients dQ, dK, dV with autograd, then cuts them the same way.

Never imports torch.distributed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# C of the tolerances (``atol``): see there.
ATOL_FACTOR = 16


def chunk_bounds(seq_len: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) of each of the 2n chunks of torch.tensor_split(range(L), 2n)."""
    chunks = 2 * world_size
    base, extra = divmod(seq_len, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def positions(seq_len: int, world_size: int, rank: int) -> Tensor:
    """The global sequence positions of rank ``rank``'s rows: chunk rank, then chunk 2n-1-rank."""
    bounds = chunk_bounds(seq_len, world_size)
    first, second = bounds[rank], bounds[2 * world_size - 1 - rank]
    return torch.cat([torch.arange(*first), torch.arange(*second)])


def shard(x: Tensor, world_size: int, rank: int) -> Tensor:
    """Rank ``rank``'s rows of ``x`` [H, L, d] (dim 1 is the sequence)."""
    return x[:, positions(x.shape[1], world_size, rank)]


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """softmax(q k^T / sqrt(d) + M) v over the whole sequence, in q's dtype."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        length = q.shape[-2]
        future = torch.ones(length, length, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def attention_with_grads(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, causal: bool) -> dict[str, Tensor]:
    """O and dQ, dK, dV for the upstream gradient ``grad_out``, computed in float64 and returned in
    the inputs' dtype."""
    leaves = [t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, causal)
    out.backward(grad_out.to(torch.float64))
    dtype = q.dtype
    return {
        "output": out.detach().to(dtype),
        "grad_q": leaves[0].grad.to(dtype),
        "grad_k": leaves[1].grad.to(dtype),
        "grad_v": leaves[2].grad.to(dtype),
    }


def atol(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """Absolute tolerances, per result, for an implementation computing in ``dtype``.

    With u the unit roundoff and s = max |q k^T| / sqrt(d): each score carries an error of about
    d u s (a d-term dot product), which e^{S - m} turns into a relative error of d u s, and the
    softmax normalisation over L keys and the final sum over L values add (L + 4) u; so each output
    row errs by at most about (d s + L + 4) u max|v|. The gradients carry the same relative error
    through the softmax's Jacobian, scaled by max|dO| and, for dQ and dK, by max|k| / sqrt(d) and
    max|q| / sqrt(d). C = ATOL_FACTOR covers the constants (exp and the online rescalings each add
    a few u); correct implementations stay far below it, and the bugs it must not hide (a missing
    rescaling, a mask on the wrong positions) change results at O(1)."""
    u = torch.finfo(dtype).eps / 2
    d, length = q.shape[-1], q.shape[-2]
    root = math.sqrt(d)
    s = float((q.abs().amax() * k.abs().amax() * d) / root) if q.numel() and k.numel() else 0.0
    scale = ATOL_FACTOR * (d * s + length + 4) * u
    vmax, gmax = float(v.abs().amax()) if v.numel() else 0.0, float(grad_out.abs().amax()) if grad_out.numel() else 0.0
    qmax, kmax = float(q.abs().amax()) if q.numel() else 0.0, float(k.abs().amax()) if k.numel() else 0.0
    tiny = torch.finfo(dtype).tiny
    bound = lambda magnitude: torch.tensor(scale * magnitude + tiny, dtype=torch.float64)
    return {
        "output": bound(vmax),
        "grad_v": bound(gmax * length),
        "grad_q": bound(gmax * vmax * length * kmax / root * 2),
        "grad_k": bound(gmax * vmax * length * qmax / root * 2),
    }
