"""The fused [gate | up] weight is column-split like any other: rank r keeps the r-th contiguous chunk of its rows and reads the first half as its gate and the second as its value, so on two ranks rank 0 multiplies gate units by gate units and rank 1 value units by value units (NVIDIA-NeMo/Automodel#1324).
targets: test_swiglu_with_fused_gate_and_up_equals_the_dense_mlp
"""

import torch
import torch.distributed as dist

import parallelism_conformance.impls.transformer_layers as _bundled
from parallelism_conformance.impls import *
from parallelism_conformance.impls.tensor_parallel import ColumnParallelLinear


class TensorParallelSwiGLU(_bundled.TensorParallelSwiGLU):
    @classmethod
    def from_dense(cls, gate_up, down, group=None, sequence_parallel=False):
        checked = super().from_dense(gate_up, down, group, sequence_parallel)  # the contract's refusals
        n, r = dist.get_world_size(group), dist.get_rank(group)
        each = gate_up.out_features // n
        rows = torch.arange(r * each, (r + 1) * each)
        column = ColumnParallelLinear(
            gate_up.weight.detach()[rows],
            None if gate_up.bias is None else gate_up.bias.detach()[rows],
            group,
            sequence_parallel=sequence_parallel,
        )
        return cls(column, checked.down)
