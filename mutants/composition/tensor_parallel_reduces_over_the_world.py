"""Tensor parallelism's all-reduces (Megatron's f and g) run on the default group instead of the layer's group: right on one group of all ranks, wrong once a mesh has several.
targets: test_tensor_parallel_rows_and_data_parallel_columns_equal_the_dense_mlp
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import tensor_parallel as _tensor_parallel

_correct = _tensor_parallel._all_reduce


def _over_the_world(x, group):
    return _correct(x, None)


_tensor_parallel._all_reduce = _over_the_world
