"""A unit's all-gather is launched asynchronously as a prefetch and waited for only when the next unit gathers (or backward starts): the unit computes with its weight while the gather may still be in flight.
targets: test_training_matches_one_process_and_memory_is_sharded
race: killed by --perturb-timing, naming the call; without it by values only when gloo's timing shows it (docs/measured.md)

The bundled FSDP gathers a unit's parameters synchronously before its forward. This one overlaps:
dist.all_gather_into_tensor(async_op=True), the work kept, and every kept work waited for at the
start of the next gather or of the reduce-scatter in backward, which is where the author thought
the prefetch of the next unit would be consumed. The unit's own forward reads the gathered weight
before its wait; on gloo the gather lands first only sometimes (2 of 2 runs without
--perturb-timing failed as nondeterminism).
"""

import torch
import torch.distributed as dist

from mutants._swap import swapped
from parallelism_conformance.impls import *  # noqa: F403
from parallelism_conformance.impls import fully_sharded as _bundled
from parallelism_conformance.impls.fully_sharded import *  # noqa: F403

_prefetched = []


def _wait_for_prefetches():
    while _prefetched:
        _prefetched.pop(0).wait()


class _PrefetchingGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, piece, n, group, divisor):
        ctx.n, ctx.group, ctx.divisor = n, group, divisor
        _wait_for_prefetches()  # the previous unit's gather, whose weight that unit already used
        full = piece.new_empty(piece.numel() * n)
        _prefetched.append(dist.all_gather_into_tensor(full, piece.detach().contiguous(), group=group, async_op=True))
        return full  # the bug: used by this unit's forward before its wait

    @staticmethod
    def backward(ctx, grad):
        _wait_for_prefetches()
        piece = grad.new_empty(grad.numel() // ctx.n)
        dist.reduce_scatter_tensor(piece, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return piece / ctx.divisor, None, None, None


def fully_shard(module, *args, **kwargs):
    module = _bundled.fully_shard(module, *args, **kwargs)
    forward = module.forward

    def prefetching_forward(*a, **k):
        with swapped(_bundled, _Gather=_PrefetchingGather):
            return forward(*a, **k)

    module.forward = prefetching_forward
    return module
