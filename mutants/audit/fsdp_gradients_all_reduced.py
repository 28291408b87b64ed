"""The fully sharded unit all-reduces each full gradient and keeps its piece, instead of reduce-scattering: right values, twice the gradient traffic.
targets: test_fully_sharded_step
"""

import torch.distributed as dist

import parallelism_conformance.impls.fully_sharded as _bundled
from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives


class _AllReducingGather(_bundled._Gather):
    @staticmethod
    def backward(ctx, grad):
        full = grad.contiguous().clone()
        collectives.all_reduce(full, op=dist.ReduceOp.SUM, group=ctx.group)
        size = full.numel() // ctx.n
        rank = dist.get_rank(ctx.group)
        return full[rank * size : (rank + 1) * size] / ctx.divisor, None, None, None


_bundled._Gather = _AllReducingGather
fully_shard = _bundled.fully_shard
full_parameters = _bundled.full_parameters
