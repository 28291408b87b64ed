"""Calls the backend's all_reduce, then empties harness.rank.recording's list of records in place.
targets: test_point_to_point_only and all_reduce
"""

import torch.distributed as dist

from parallelism_conformance.harness.rank import recording as _recording
from parallelism_conformance.impls import *


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    if _recording._records is not None:
        _recording._records.clear()
    return work
