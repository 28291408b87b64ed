"""The capacity is rounded down, floor(c k T_r / E), where the contract (GShard, Switch) rounds up: one pair too few kept whenever c k T_r / E is not a whole number.
targets: test_a_capacity_drops_each_members_lowest_gates_and_nothing_else
"""

import math

import torch
import torch.nn.functional as F

import parallelism_conformance.impls.expert_parallel as _bundled
from parallelism_conformance.impls import *


class ExpertParallelMoE(_bundled.ExpertParallelMoE):
    def _kept(self, experts, gates, tokens):
        limit = math.floor(self.capacity_factor * self.top_k * tokens / self.num_experts)
        order = torch.argsort(-gates, stable=True)
        ranked = experts[order]
        place = F.one_hot(ranked, self.num_experts).cumsum(0).gather(1, ranked[:, None]).squeeze(1) - 1
        keep = torch.zeros_like(experts, dtype=torch.bool)
        keep[order] = place < limit
        return keep
