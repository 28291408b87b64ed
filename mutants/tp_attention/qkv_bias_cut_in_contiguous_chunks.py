"""The fused QKV weight's rows are picked by head, but its bias is cut into contiguous chunks, as a plain column-parallel bias is: each rank adds another head's bias to its queries, keys and values (the weight's fix in NVIDIA-NeMo/Automodel#1324 not carried to the bias, which Qwen-style attention has).
targets: test_attention_split_by_head_equals_the_dense_block
"""

import torch
import torch.distributed as dist

import parallelism_conformance.impls.transformer_layers as _bundled
from parallelism_conformance.impls import *


class TensorParallelAttention(_bundled.TensorParallelAttention):
    @classmethod
    def from_dense(cls, qkv, out, num_heads, num_kv_heads, group=None, sequence_parallel=False, qkv_layout="concatenated"):
        layer = super().from_dense(qkv, out, num_heads, num_kv_heads, group, sequence_parallel, qkv_layout)
        if qkv.bias is not None:
            n, r = dist.get_world_size(group), dist.get_rank(group)
            each = qkv.out_features // n
            with torch.no_grad():
                layer.qkv.bias.copy_(qkv.bias[r * each : (r + 1) * each])
        return layer
