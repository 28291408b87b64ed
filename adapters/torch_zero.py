"""ShardedOptimizer built on torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO stage 1).

torch's ZeroRedundancyOptimizer partitions whole parameters across ranks (largest first, to the
least-loaded rank), keeps each one's state on its owner only (``.optim``), and after the local step
broadcasts every parameter from its owner. It expects the gradients to be averaged already (it is
meant to run after DDP), so ``step`` first all-reduces each gradient with AVG: right values, at the
cost of an all-reduce where a reduce to the owner would do. Frozen parameters are left out, as
torch's optimizers leave them alone.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer


class ShardedOptimizer(ZeroRedundancyOptimizer):
    def __init__(self, params, optimizer_class, group=None, **defaults):
        self._trainable = [p for p in params if p.requires_grad]
        self._group = group
        super().__init__(self._trainable, optimizer_class, process_group=group, **defaults)

    def step(self, closure=None):
        for p in self._trainable:
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=self._group)
        return super().step(closure)
