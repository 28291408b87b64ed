"""all_reduce drops the tail when numel is not divisible by the group size (it is never reduced).
targets: test_all_reduce and MAX
"""

import torch
import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    n = dist.get_world_size(group)
    even = tensor.numel() - tensor.numel() % n
    flat = tensor.reshape(-1)
    head = flat[:even].clone()
    impls.all_reduce(head, op=op, group=group)
    flat[:even].copy_(head)
