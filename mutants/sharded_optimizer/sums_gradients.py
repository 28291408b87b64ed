"""The owner sums the gradients over ranks instead of averaging them (the division by n is missing).
targets: test_sharded_training_matches_one_process_with_the_whole_state
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls.sharded_optimizer import ShardedOptimizer as _Correct


class ShardedOptimizer(_Correct):
    def _average_my_gradients(self):
        slots = super()._average_my_gradients()
        for p, _ in self._mine(slots):
            if p.grad is not None:
                p.grad.mul_(self.world_size)
        return slots
