"""The layer exchanges tokens with all_to_all_single over the default group, ignoring the expert-parallel group it was built on: right when expert parallelism spans the world, on a mesh its splits count one group's members while the exchange spans every replica's.
targets: expert_parallel_inside
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives, expert_parallel


def _over_the_world(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    return collectives.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=None, async_op=async_op)


class ExpertParallelMoE(expert_parallel.ExpertParallelMoE):
    exchange = staticmethod(_over_the_world)
