"""Each member computes the load-balancing loss on its own tokens (f and P over its T_r tokens, no all-reduce of the counts): it balances its own tokens, not the group's batch, and the shares do not add up to the group's loss.
targets: test_top_k_routing_and_the_load_balancing_loss_over_the_group
"""

import torch

import parallelism_conformance.impls.expert_parallel as _bundled
from parallelism_conformance.impls import *


class ExpertParallelMoE(_bundled.ExpertParallelMoE):
    def _load_balancing_share(self, probabilities, chosen):
        total = probabilities.shape[0]
        if total == 0:
            return probabilities.sum() * 0
        counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts).to(probabilities.dtype)
        f = counts / (self.top_k * total)
        return self.num_experts * (f * probabilities.mean(0)).sum()
