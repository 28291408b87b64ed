"""dK and dV stay with the rank whose queries produced them: the ring's backward returns zeros instead of sending them home.
targets: test_ring_attention_equals_dense_attention

Each rank's dK, dV then hold only what its own queries contribute. Right on one rank.
"""

import torch

import parallelism_conformance.impls.context_parallel as _bundled
from parallelism_conformance.impls import *


class _NoWayBack(_bundled._PassAlongRing):
    @staticmethod
    def backward(ctx, grad):
        return torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device), None, None


def context_parallel_attention(q, k, v, seq_len, causal=False, group=None):
    original = _bundled._PassAlongRing
    _bundled._PassAlongRing = _NoWayBack
    try:
        return _bundled.context_parallel_attention(q, k, v, seq_len, causal=causal, group=group)
    finally:
        _bundled._PassAlongRing = original
