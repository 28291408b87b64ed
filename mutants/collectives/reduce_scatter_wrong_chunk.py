"""reduce_scatter_tensor hands each rank the next rank's chunk of the reduction.
targets: test_reduce_scatter_tensor and SUM
"""

import torch
import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    n = dist.get_world_size(group)
    full = input.clone()
    impls.all_reduce(full, op=op, group=group)
    chunk = (dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()) + 1
    output.copy_(full.reshape(n, *output.shape)[chunk % n])
