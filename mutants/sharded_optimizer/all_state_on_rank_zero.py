"""Rank 0 owns every parameter: right values, but nothing is split (rank 0 holds the whole optimizer state).
targets: test_sharded_training_matches_one_process_with_the_whole_state
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import sharded_optimizer


class ShardedOptimizer(sharded_optimizer.ShardedOptimizer):
    def __init__(self, params, optimizer_class, group=None, **defaults):
        original = sharded_optimizer.assign_owners
        sharded_optimizer.assign_owners = lambda sizes, world_size: [0] * len(sizes)
        try:
            super().__init__(params, optimizer_class, group=group, **defaults)
        finally:
            sharded_optimizer.assign_owners = original
