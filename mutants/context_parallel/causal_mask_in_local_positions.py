"""The causal mask compares row and key indices within the shards instead of global sequence positions.
targets: test_causal_ring_attention_across_ranks

A query may attend to a key when key index <= query index, counted inside this rank's rows and
inside the block: right on one rank with a contiguous shard, wrong as soon as blocks come from
other ranks (every key of an earlier chunk is visible, every key of a later chunk is not).
"""

import math

import torch
import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls.context_parallel import _chunk_rows, _PassAlongRing


def context_parallel_attention(q, k, v, seq_len, causal=False, group=None):
    n, rank = dist.get_world_size(group), dist.get_rank(group)
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
        if causal:  # the bug: local indices
            local = torch.arange(scores.shape[-1])[None, :] > torch.arange(scores.shape[-2])[:, None]
            scores = scores.masked_fill(local, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True).detach())
        shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        rescale, weights = torch.exp(running_max - shift), torch.exp(scores - shift)
        total = total * rescale + weights.sum(dim=-1, keepdim=True)
        accumulated = accumulated * rescale + weights @ block[1]
        running_max = new_max
    return accumulated / total
