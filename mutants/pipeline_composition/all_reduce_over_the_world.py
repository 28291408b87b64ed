"""all_reduce ignores its group and reduces over the whole world: the data-parallel average mixes in the other stages' replicas.
targets: data_parallel_pipelines

On a pp x dp mesh the data-parallel group of stage s is {s dp + d}; reducing over the world sums
gradients of different stages (or fails on their different shapes). Its own capability's tests
on the whole world pass.
"""

from torch.distributed import ReduceOp

from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives as _collectives
from parallelism_conformance.impls.pipeline_parallel import *


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return _collectives.all_reduce(tensor, op=op, group=None, async_op=async_op)
