"""Under sequence parallelism the router's gradient is averaged over the group instead of summed (the data-parallel habit): each member's sequence shard contributes 1/n of its part, the gradient is n times too small and the same on every member, so the replicas agree and only the values show it.
targets: test_a_router_replicated_over_a_sequence_parallel_group_gets_the_whole_gradient
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parallelism_conformance.impls.expert_parallel as _bundled
from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives


class _Averaged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, group):
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        collectives.all_reduce(grad, op=dist.ReduceOp.AVG, group=ctx.group)
        return grad, None


class ExpertParallelMoE(_bundled.ExpertParallelMoE):
    def _logits(self, x):
        if not self.sequence_parallel:
            return self.router(x)
        return F.linear(x, _Averaged.apply(self.router.weight, self.group), self.router.bias)
