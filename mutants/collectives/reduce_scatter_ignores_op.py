"""reduce_scatter (list form) ignores op and always sums.
targets: test_reduce_scatter and not tensor and MAX
"""

import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return impls.reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
