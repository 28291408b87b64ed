"""Grouped-query attention pairs query head i with key/value head i mod H_kv (repeat instead of repeat_interleave) instead of i // (H / H_kv): each query head attends with another group's keys and values, the same on every rank, so the layout checks pass and only the values show it.
targets: test_attention_split_by_head_equals_the_dense_block
"""

import math

import torch

import parallelism_conformance.impls.transformer_layers as _bundled
from parallelism_conformance.impls import *


class TensorParallelAttention(_bundled.TensorParallelAttention):
    def forward(self, x):
        q, k, v = self._split_heads(self.qkv(x))
        group = self.heads // self.kv_heads
        k, v = k.repeat(*[1] * (k.dim() - 3), group, 1, 1), v.repeat(*[1] * (v.dim() - 3), group, 1, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        seq = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        return self.out((torch.softmax(scores, dim=-1) @ v).transpose(-2, -3).flatten(-2))
