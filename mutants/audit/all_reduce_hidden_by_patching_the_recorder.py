"""Calls the backend's all_reduce and replaces harness.rank.recording.stop so the rank reports no calls at all.
targets: test_point_to_point_only and all_reduce

From issue 13: the recorder lives in the rank, so code in the rank can rewrite it. The kernel's count
of the bytes the rank wrote (read by the driver) still shows the traffic.
"""

import torch.distributed as dist

from parallelism_conformance.harness.rank import recording as _recording
from parallelism_conformance.impls import *

_recording.stop = lambda: []


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
