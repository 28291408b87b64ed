"""all_to_all_single ignores the split sizes whenever the input divides evenly, splitting it into equal pieces.
targets: test_all_to_all_single
"""

import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    n = dist.get_world_size(group)
    if input.shape[0] % n == 0 and input_split_sizes is not None:
        input_split_sizes = [input.shape[0] // n] * n
    return impls.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
