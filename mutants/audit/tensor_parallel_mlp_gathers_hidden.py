"""TensorParallelMLP all-gathers the hidden activation and lets the row layer slice it again: right values, an all-gather of [..., ffn] per pass.
targets: test_tensor_parallel_traffic and mlp
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP, _check_divisible, _size


class _GatheringMLP(TensorParallelMLP):
    @classmethod
    def from_dense(cls, fc1, fc2, group=None, sequence_parallel=False):
        _check_divisible("ffn width (fc1.out_features = fc2.in_features)", fc1.out_features, _size(group))
        column = ColumnParallelLinear.from_dense(fc1, group, gather_output=True)
        row = RowParallelLinear.from_dense(fc2, group, input_is_parallel=False)
        return cls(column, row, group, sequence_parallel)


TensorParallelMLP = _GatheringMLP
