"""Under sequence parallelism the LayerNorm before the MLP runs on the sequence shard and its weight and bias gradients are never all-reduced: each rank keeps the gradient of its own shard (Megatron-LM#1446, gpt-neox#1257: LayerNorm gradients that differ per tensor-parallel rank).
targets: test_a_layernorm_before_the_mlp_keeps_whole_gradients
"""

import parallelism_conformance.impls.tensor_parallel as _bundled
from parallelism_conformance.impls import *


class TensorParallelMLP(_bundled.TensorParallelMLP):
    def _normed(self, x):
        return x if self.norm is None else self.norm(x)
