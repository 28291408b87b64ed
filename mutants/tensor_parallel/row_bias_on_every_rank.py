"""RowParallelLinear adds the bias on every rank before the all-reduce, so the output carries n times the bias.
targets: test_row_parallel_linear or test_mlp_equals

Mutant of impls.tensor_parallel for the grading mutation suite: everything else is the bundled
implementation. The TensorParallelMLP builds its fc2 with this RowParallelLinear.
"""

import torch.nn.functional as F

from parallelism_conformance.impls import *  # the bundled collectives
from parallelism_conformance.impls import tensor_parallel as _tp
from parallelism_conformance.impls.tensor_parallel import *


class RowParallelLinear(_tp.RowParallelLinear):
    def forward(self, x):
        if not self.input_is_parallel:
            x = _tp.scatter_to_parallel_region(x, self.group)
        partial = F.linear(x, self.weight, self.bias)  # BUG: b joins every rank's partial sum
        if self.sequence_parallel:
            return _tp.reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return _tp.reduce_from_parallel_region(partial, self.group)


class TensorParallelMLP(_tp.TensorParallelMLP):
    @classmethod
    def from_dense(cls, fc1, fc2, group=None, sequence_parallel=False):
        mlp = _tp.TensorParallelMLP.from_dense(fc1, fc2, group, sequence_parallel)
        mlp.fc2.__class__ = RowParallelLinear
        return mlp
