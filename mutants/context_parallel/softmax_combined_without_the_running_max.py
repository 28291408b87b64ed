"""Blocks are combined without rescaling by the running maximum: the accumulator keeps sums taken against an older maximum.
targets: test_ring_attention_equals_dense_attention

The online-softmax rule multiplies the running sum and accumulator by e^{m - m'} whenever a block
raises a row's maximum; this one subtracts each block's own new maximum but never rescales what
was accumulated before. Right when the first block already holds every row's maximum (one rank,
or luck), wrong otherwise.
"""

import math

import torch
import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls.context_parallel import _chunk_rows, _PassAlongRing


def context_parallel_attention(q, k, v, seq_len, causal=False, group=None):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = _chunk_rows(seq_len, n, rank)
    scale = 1.0 / math.sqrt(q.shape[-1])
    rows = (*q.shape[:-1], 1)
    running_max = q.new_full(rows, float("-inf"))
    total, accumulated = q.new_zeros(rows), torch.zeros_like(q)
    block, owner = torch.stack([k, v]), rank
    for step in range(n):
        if step:
            owner = (owner - 1) % n
            block = _PassAlongRing.apply(block, (2, *k.shape[:-2], len(_chunk_rows(seq_len, n, owner)), k.shape[-1]), group)
        scores = q @ block[0].transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(_chunk_rows(seq_len, n, owner)[None, :] > mine[:, None], float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True).detach())
        shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        weights = torch.exp(scores - shift)
        total = total + weights.sum(dim=-1, keepdim=True)  # the bug: no e^{m - m'} on what came before
        accumulated = accumulated + weights @ block[1]
        running_max = new_max
    return accumulated / total
