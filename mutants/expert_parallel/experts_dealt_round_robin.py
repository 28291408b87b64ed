"""Rank r keeps experts r, r+n, r+2n, ... (round robin) while tokens are sent to expert e's contiguous block owner e // (E/n): tokens meet the wrong expert.
targets: test_expert_parallel_moe_equals_one_process_with_every_expert
"""

import copy

import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls.expert_parallel import ExpertParallelMoE as _Correct


class ExpertParallelMoE(_Correct):
    @classmethod
    def from_dense(cls, router, experts, group=None):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        experts = list(experts)
        if len(experts) % n:
            raise ValueError(f"num_experts = {len(experts)} is not divisible by the group size {n}")
        return cls(router, [copy.deepcopy(e) for e in experts[r::n]], len(experts), group)
