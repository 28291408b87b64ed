"""Each shard draws its hidden dropout mask on its own shape: the members' generators are in the same state, so every shard gets the same mask and the dropout is correlated across the hidden units (why Megatron keeps a separate stream for the sharded region).
targets: dropout
"""

import torch

from parallelism_conformance.impls import *
from parallelism_conformance.impls import tensor_parallel


class TensorParallelMLP(tensor_parallel.TensorParallelMLP):
    def _slice_of_dense_mask(self, local, dim):
        if dim == -1:
            return torch.empty_like(local).bernoulli_(1 - self.dropout).div_(1 - self.dropout)
        return super()._slice_of_dense_mask(local, dim)
