"""Rank 0 draws one more number from the default generator than the other members (Megatron-LM#206: the data loader used the generator on tensor-parallel rank 0 only): from then on the members' masks differ, and the replicated output drifts apart across them.
targets: dropout
"""

import torch
import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls import tensor_parallel


class TensorParallelMLP(tensor_parallel.TensorParallelMLP):
    def _slice_of_dense_mask(self, local, dim):
        if dim != -1 and dist.get_rank(self.group) == 0:
            torch.rand(1)
        return super()._slice_of_dense_mask(local, dim)
