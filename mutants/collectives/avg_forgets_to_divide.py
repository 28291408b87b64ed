"""all_reduce with op=AVG returns the sum: the division by the group size is forgotten.
targets: test_all_reduce and AVG
"""

import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if op == dist.ReduceOp.AVG:
        op = dist.ReduceOp.SUM
    return impls.all_reduce(tensor, op=op, group=group, async_op=async_op)
