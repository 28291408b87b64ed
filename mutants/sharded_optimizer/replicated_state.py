"""Every rank averages all gradients and steps every parameter itself: right values, but the whole optimizer state on every rank (no sharding).
targets: test_sharded_training_matches_one_process_with_the_whole_state
"""

import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives


class ShardedOptimizer:
    def __init__(self, params, optimizer_class, group=None, **defaults):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.optim = optimizer_class(self.params, **defaults)

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self):
        for p in self.params:
            if p.grad is not None:
                collectives.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=self.group)
        self.optim.step()
