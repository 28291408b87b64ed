"""Under sequence parallelism attention runs on this rank's sequence shard: the input is not all-gathered before the QKV projection (and the output projection all-reduces instead of reduce-scattering), so each position attends only to the positions of its own shard, with the causal mask of local positions (the all-gather a sequence-parallel attention needs, Korthikanti et al. 2022 sec. 4.2.2, left out).
targets: test_attention_split_by_head_equals_the_dense_block and sequence_parallel
"""

import parallelism_conformance.impls.transformer_layers as _bundled
from parallelism_conformance.impls import *


class TensorParallelAttention(_bundled.TensorParallelAttention):
    @classmethod
    def from_dense(cls, qkv, out, num_heads, num_kv_heads, group=None, sequence_parallel=False, qkv_layout="concatenated"):
        return super().from_dense(qkv, out, num_heads, num_kv_heads, group, False, qkv_layout)
