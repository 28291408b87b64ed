"""Under sequence parallelism the row layer's bias is cast to the compute dtype before Megatron's f, so its gradient is summed across the group in bfloat16 or float16, not in the masters' float32 (pytorch#190626: FSDP2's reduce_dtype not applied to the tensor-parallel gradient all-reduce).
targets: compute_dtype
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import tensor_parallel


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    def forward(self, x):
        partial = tensor_parallel.F.linear(x, tensor_parallel._cast(self.weight, self.compute_dtype))
        y = tensor_parallel.reduce_scatter_to_sequence_parallel_region(partial, self.group)
        bias = tensor_parallel._cast(self.bias, self.compute_dtype)
        return y + tensor_parallel.copy_to_parallel_region(bias, self.group)


class TensorParallelMLP(tensor_parallel.TensorParallelMLP):
    @classmethod
    def from_dense(cls, fc1, fc2, group=None, sequence_parallel=False, norm=None, dropout=0.0, compute_dtype=None):
        mlp = super().from_dense(fc1, fc2, group, sequence_parallel, norm, dropout, compute_dtype)
        if sequence_parallel and mlp.fc2.bias is not None:
            row = RowParallelLinear(mlp.fc2.weight, mlp.fc2.bias, group, True, True)
            row.compute_dtype = compute_dtype
            mlp.fc2 = row
        return mlp
