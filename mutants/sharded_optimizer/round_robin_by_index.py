"""Parameters dealt to ranks round-robin by registration index (i % n), whatever their sizes: right values, but on a model whose weights and biases alternate one rank holds every weight's state (the partition of most CS336 assignment-2 submissions we ran).
targets: test_sharded_training_matches_one_process_with_the_whole_state
"""
from impls import *  # noqa
from impls import sharded_optimizer


class ShardedOptimizer(sharded_optimizer.ShardedOptimizer):
    def __init__(self, params, optimizer_class, group=None, **defaults):
        original = sharded_optimizer.assign_owners
        sharded_optimizer.assign_owners = lambda sizes, world_size: [i % world_size for i in range(len(sizes))]
        try:
            super().__init__(params, optimizer_class, group=group, **defaults)
        finally:
            sharded_optimizer.assign_owners = original
