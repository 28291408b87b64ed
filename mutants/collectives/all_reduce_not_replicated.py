"""all_reduce reduces in a rank-dependent order in floating point, so ranks disagree in the last bits.
targets: test_all_reduce and SUM or order_sensitive
"""

import torch
import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if op != dist.ReduceOp.SUM or not tensor.is_floating_point():
        return impls.all_reduce(tensor, op=op, group=group, async_op=async_op)
    n = dist.get_world_size(group)
    pieces = [torch.empty_like(tensor) for _ in range(n)]
    impls.all_gather(pieces, tensor.contiguous(), group=group)
    me = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
    total = torch.zeros_like(tensor)
    for i in range(n):  # start the sum at a different rank on every rank
        total += pieces[(me + i) % n]
    tensor.copy_(total)
