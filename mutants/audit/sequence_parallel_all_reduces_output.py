"""The sequence-parallel row layer all-reduces its partial output and keeps its sequence shard instead of reduce-scattering: right values and gradients, an all-reduce where a reduce-scatter suffices.
targets: test_tensor_parallel_traffic and mlp_sp
"""

import torch

from parallelism_conformance.impls import *
from parallelism_conformance.impls.tensor_parallel import (
    RowParallelLinear,
    _all_gather,
    _all_reduce,
    _check_sequence,
    _split,
    copy_to_parallel_region,
)
from parallelism_conformance.impls.tensor_parallel import TensorParallelMLP as _Correct


class _AllReduceThenSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(_all_reduce(x, group), -2, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -2, ctx.group), None


class _AllReducingRow(RowParallelLinear):
    def forward(self, x):
        if not self.sequence_parallel:
            return super().forward(x)
        partial = torch.nn.functional.linear(x, self.weight)
        _check_sequence(partial, self.group)
        y = _AllReduceThenSplit.apply(partial, self.group)
        return y if self.bias is None else y + copy_to_parallel_region(self.bias, self.group)


class _MLP(_Correct):
    @classmethod
    def from_dense(cls, fc1, fc2, group=None, sequence_parallel=False):
        mlp = _Correct.from_dense(fc1, fc2, group, sequence_parallel)
        mlp.fc2.__class__ = _AllReducingRow
        return mlp


TensorParallelMLP = _MLP
