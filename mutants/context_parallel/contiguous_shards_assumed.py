"""The implementation assumes contiguous shards (rank i holds rows i*L/n onward), not the load-balanced chunks i and 2n-1-i.
targets: test_causal_ring_attention_across_ranks

Its masks then compare the wrong global positions: right without a mask and on one rank.
"""

import torch

import parallelism_conformance.impls.context_parallel as _bundled
from parallelism_conformance.impls import *


def _contiguous_rows(seq_len, n, rank):
    bounds = [len(t) for t in torch.tensor_split(torch.arange(seq_len), 2 * n)]
    mine = bounds[rank] + bounds[2 * n - 1 - rank]  # the right count, the wrong positions
    start = sum(bounds[c] + bounds[2 * n - 1 - c] for c in range(rank))
    return torch.arange(start, start + mine)


def context_parallel_attention(q, k, v, seq_len, causal=False, group=None):
    original = _bundled._chunk_rows
    _bundled._chunk_rows = _contiguous_rows
    try:
        return _bundled.context_parallel_attention(q, k, v, seq_len, causal=causal, group=group)
    finally:
        _bundled._chunk_rows = original
