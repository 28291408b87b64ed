"""reduce always delivers the result to the first member of the group, whatever dst says.
targets: test_reduce and SUM
"""

import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def reduce(tensor, dst=None, op=dist.ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    return impls.reduce(tensor, op=op, group=group, async_op=async_op, group_dst=0)
