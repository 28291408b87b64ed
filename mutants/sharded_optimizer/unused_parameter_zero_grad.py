"""A parameter no forward used in a step gets a zero gradient instead of None, so the owner's optimizer still moves it (momentum, weight decay) where one process would skip it.
targets: test_sharded_training_matches_one_process_with_the_whole_state
"""

import torch

from parallelism_conformance.impls import *
from parallelism_conformance.impls.sharded_optimizer import ShardedOptimizer as _Correct


class ShardedOptimizer(_Correct):
    def step(self):
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        super().step()
