"""The "ring all-reduce" just calls torch.distributed.all_reduce: right values, no ring, not point-to-point.
targets: test_point_to_point_only and all_reduce
"""

import torch.distributed as dist

from parallelism_conformance.impls import *


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
