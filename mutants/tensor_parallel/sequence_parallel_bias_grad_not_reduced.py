"""With sequence parallelism the row layer's bias gradient is not all-reduced: each rank's dL/db2 covers its own sequence shard only.
targets: test_sequence_parallel

Mutant of impls.tensor_parallel for the grading mutation suite: everything else is the bundled
implementation. Only TensorParallelMLP(..., sequence_parallel=True) is affected.
"""

import torch.nn.functional as F

from parallelism_conformance.impls import *  # the bundled collectives
from parallelism_conformance.impls import tensor_parallel as _tp
from parallelism_conformance.impls.tensor_parallel import *


class _RowParallelLinear(_tp.RowParallelLinear):
    def forward(self, x):
        if not self.sequence_parallel:
            return super().forward(x)
        y = _tp.reduce_scatter_to_sequence_parallel_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias  # BUG: the bias gradient needs f (all-reduce backward)


class TensorParallelMLP(_tp.TensorParallelMLP):
    @classmethod
    def from_dense(cls, fc1, fc2, group=None, sequence_parallel=False):
        mlp = _tp.TensorParallelMLP.from_dense(fc1, fc2, group, sequence_parallel)
        mlp.fc2.__class__ = _RowParallelLinear
        return mlp
