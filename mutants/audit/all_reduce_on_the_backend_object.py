"""Calls all_reduce on the backend object behind the group (group._get_backend), below the recorder.
targets: test_point_to_point_only and all_reduce
"""

import torch
import torch.distributed as dist

from parallelism_conformance.impls import *


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    group = group or dist.group.WORLD
    backend = group._get_backend(tensor.device)
    options = dist.AllreduceOptions()
    options.reduceOp = op if isinstance(op, dist.ReduceOp) else getattr(dist.ReduceOp, str(op))
    work = backend.allreduce([tensor], options)
    work.wait()
    return None
