"""all_gather_into_tensor concatenates the ranks' pieces in reverse rank order.
targets: test_all_gather_into_tensor
"""

import torch
import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    impls.all_gather_into_tensor(output_tensor, input_tensor, group=group)
    n = dist.get_world_size(group)
    pieces = output_tensor.reshape(n, -1).flip(0).clone()
    output_tensor.copy_(pieces.reshape(output_tensor.shape))
