"""Under sequence parallelism the down projection's bias is added to the sequence shard and its gradient is never all-reduced: each rank keeps the gradient of its own positions (the bias of a row-parallel layer in the sequence-parallel region, Megatron-LM#1446's class of bug).
targets: test_swiglu_with_fused_gate_and_up_equals_the_dense_mlp and sequence_parallel
"""

import parallelism_conformance.impls.tensor_parallel as _tp
import parallelism_conformance.impls.transformer_layers as _bundled
from parallelism_conformance.impls import *


class _Row(_tp.RowParallelLinear):
    def forward(self, x):
        partial = _tp.F.linear(x, self.weight)
        y = _tp.reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return y if self.bias is None else y + self.bias


class TensorParallelSwiGLU(_bundled.TensorParallelSwiGLU):
    @classmethod
    def from_dense(cls, gate_up, down, group=None, sequence_parallel=False):
        layer = super().from_dense(gate_up, down, group, sequence_parallel)
        if sequence_parallel:
            layer.down.__class__ = _Row
        return layer
