"""Megatron's g operator all-reduces in backward too (it must be the identity there), so every gradient upstream of a row-parallel layer is n times too large.
targets: test_row_parallel_linear or test_mlp_equals

Mutant of impls.tensor_parallel for the grading mutation suite: everything else is the bundled
implementation. The TensorParallelMLP builds its fc2 with this RowParallelLinear.
"""

import torch
import torch.nn.functional as F

from parallelism_conformance.impls import *  # the bundled collectives
from parallelism_conformance.impls import tensor_parallel as _tp
from parallelism_conformance.impls.tensor_parallel import *


class _AllReduceBothWays(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _tp._all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _tp._all_reduce(grad, ctx.group), None  # BUG: g's backward is the identity


class RowParallelLinear(_tp.RowParallelLinear):
    def forward(self, x):
        if self.sequence_parallel:
            return super().forward(x)
        if not self.input_is_parallel:
            x = _tp.scatter_to_parallel_region(x, self.group)
        y = _AllReduceBothWays.apply(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class TensorParallelMLP(_tp.TensorParallelMLP):
    @classmethod
    def from_dense(cls, fc1, fc2, group=None, sequence_parallel=False):
        mlp = _tp.TensorParallelMLP.from_dense(fc1, fc2, group, sequence_parallel)
        mlp.fc2.__class__ = RowParallelLinear
        return mlp
