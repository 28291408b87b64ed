"""all_reduce reduces only the first 4 MiB of a large tensor (a segment loop that stops after one segment).
targets: test_large_message and all_reduce
"""

import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *

SEGMENT_ELEMENTS = (4 << 20) // 4


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    flat = tensor.reshape(-1)
    head = flat[:SEGMENT_ELEMENTS].clone()
    impls.all_reduce(head, op=op, group=group)
    flat[:SEGMENT_ELEMENTS].copy_(head)
