"""The fused [Q | K | V] weight is column-split like any other: rank r keeps the r-th contiguous chunk of its rows and reads it as its heads' [Q | K | V], so with the concatenated layout a rank gets another mix of query, key and value rows (NVIDIA-NeMo/Automodel#1324: silently wrong heads, worst under grouped-query attention).
targets: test_attention_split_by_head_equals_the_dense_block
"""

import torch

import parallelism_conformance.impls.transformer_layers as _bundled
from parallelism_conformance.impls import *


def _contiguous(layout, heads, kv_heads, d, n, r):
    each = (heads + 2 * kv_heads) * d // n
    return torch.arange(r * each, (r + 1) * each)


_bundled._my_qkv_rows = _contiguous
