"""scatter treats the global src rank as a rank within the group (right only when they coincide).
targets: test_scatter and not gather or test_a_rooted_collective_in_a_group and scatter
"""

import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    wrong_root = members[src % len(members)] if src is not None else None
    if dist.get_rank() != wrong_root:
        scatter_list = None
    elif scatter_list is None:
        scatter_list = [tensor.clone() for _ in members]
    return impls.scatter(tensor, scatter_list, src=wrong_root, group=group, async_op=async_op)
