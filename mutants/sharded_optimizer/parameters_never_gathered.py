"""Owners update their parameters but never all-gather them: every other rank keeps its old copy.
targets: test_sharded_training_matches_one_process_with_the_whole_state
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls.sharded_optimizer import ShardedOptimizer as _Correct


class ShardedOptimizer(_Correct):
    def _share_my_parameters(self, slots):
        pass
