"""Backward never sends the experts' input gradients back to the tokens' ranks: dL/dx keeps only the router's path.
targets: test_expert_parallel_moe_equals_one_process_with_every_expert
"""

import torch

from parallelism_conformance.impls import *
from parallelism_conformance.impls import expert_parallel
from parallelism_conformance.impls.expert_parallel import ExpertParallelMoE as _Correct

_exchange = expert_parallel._AllToAll


class _DispatchWithoutReturn(torch.autograd.Function):
    """The dispatch all-to-all; its backward drops the gradient instead of exchanging it."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, exchange):
        ctx.rows = x.shape[0]
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        exchange(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros((ctx.rows, *grad.shape[1:])), None, None, None, None


class _FirstCallDrops:
    """Stands in for _AllToAll during one forward: the first apply (the dispatch) drops gradients."""

    def __init__(self):
        self.calls = 0

    def apply(self, *args):
        self.calls += 1
        return (_DispatchWithoutReturn if self.calls == 1 else _exchange).apply(*args)


class ExpertParallelMoE(_Correct):
    def forward(self, x):
        expert_parallel._AllToAll = _FirstCallDrops()
        try:
            return super().forward(x)
        finally:
            expert_parallel._AllToAll = _exchange
