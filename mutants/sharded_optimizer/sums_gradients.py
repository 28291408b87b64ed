"""The owner sums the gradients over ranks instead of averaging them (the division by n is missing).
targets: test_sharded_training_matches_one_process_with_the_whole_state
"""
import torch
import torch.distributed as dist

from impls import *  # noqa
from impls import collectives
from impls.sharded_optimizer import ShardedOptimizer as _Correct


class ShardedOptimizer(_Correct):
    def _reduce_to(self, owner):
        params = self._updated_by(owner)
        if not params:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        collectives.reduce(flat, dst=self._global(owner), op=dist.ReduceOp.SUM, group=self.group)
        if owner == self.rank:
            for p, piece in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(piece.view_as(p.grad))
