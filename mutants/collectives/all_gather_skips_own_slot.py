"""all_gather never writes the calling rank's own slot of tensor_list.
targets: test_all_gather and not into
"""

import torch
import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def all_gather(tensor_list, tensor, group=None, async_op=False):
    me = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
    scratch = [t.clone() for t in tensor_list]
    impls.all_gather(scratch, tensor, group=group)
    for i, (out, got) in enumerate(zip(tensor_list, scratch)):
        if i != me:
            out.copy_(got)
