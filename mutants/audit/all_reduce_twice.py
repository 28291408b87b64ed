"""all_reduce runs a second, idempotent all-reduce (MAX) over its result: right values, twice the bytes.
targets: test_bytes_sent_within_bound and all_reduce
"""

import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    work = impls.all_reduce(tensor, op=op, group=group, async_op=async_op)
    impls.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)  # every rank holds the same values: a no-op
    return work
