"""ColumnParallelLinear skips Megatron's f operator: the input gradient is not all-reduced in backward, so each rank keeps only its own partial g_r W_r.
targets: test_column_parallel_linear or test_mlp_equals

Mutant of impls.tensor_parallel for the grading mutation suite: everything else is the bundled
implementation. The TensorParallelMLP builds its fc1 with this ColumnParallelLinear.
"""

import torch.nn.functional as F

from parallelism_conformance.impls import *  # the bundled collectives
from parallelism_conformance.impls import tensor_parallel as _tp
from parallelism_conformance.impls.tensor_parallel import *


class ColumnParallelLinear(_tp.ColumnParallelLinear):
    def forward(self, x):
        if self.sequence_parallel:
            return super().forward(x)
        y = F.linear(x, self.weight, self.bias)  # BUG: no f (identity forward, all-reduce backward) on x
        return _tp.gather_from_parallel_region(y, self.group) if self.gather_output else y


class TensorParallelMLP(_tp.TensorParallelMLP):
    @classmethod
    def from_dense(cls, fc1, fc2, group=None, sequence_parallel=False):
        mlp = _tp.TensorParallelMLP.from_dense(fc1, fc2, group, sequence_parallel)
        mlp.fc1.__class__ = ColumnParallelLinear
        return mlp
