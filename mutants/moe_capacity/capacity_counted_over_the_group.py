"""The capacity is counted on the group's tokens (ceil(c k T / E) with T every member's tokens, all-reduced) instead of the member's own, so how many of a member's pairs an expert keeps depends on the other members' batches (Megatron-Bridge#4635: outputs that depend on other expert-parallel ranks' samples).
targets: test_a_capacity_drops_each_members_lowest_gates_and_nothing_else
"""

import torch

import parallelism_conformance.impls.expert_parallel as _bundled
from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives


class ExpertParallelMoE(_bundled.ExpertParallelMoE):
    def _kept(self, experts, gates, tokens):
        total = torch.tensor([float(tokens)], dtype=torch.float64)
        collectives.all_reduce(total, group=self.group)
        return super()._kept(experts, gates, int(total.item()))
