"""Under sequence parallelism each member draws the output dropout mask on its own sequence shard's shape: every shard of the sequence gets the same mask, not its part of the dense one.
targets: dropout and True
"""

import torch

from parallelism_conformance.impls import *
from parallelism_conformance.impls import tensor_parallel


class TensorParallelMLP(tensor_parallel.TensorParallelMLP):
    def _slice_of_dense_mask(self, local, dim):
        if dim == tensor_parallel.SEQUENCE_DIM:
            return torch.empty_like(local).bernoulli_(1 - self.dropout).div_(1 - self.dropout)
        return super()._slice_of_dense_mask(local, dim)
