"""The load-balancing loss over the group's batch is averaged over the members once more (each member's share divided by n, as a loss averaged over data-parallel ranks would be): the router's gradient from it is 1/n of the right one (Megatron-LM#3672: the global aux loss averaged over the global token count twice).
targets: test_top_k_routing_and_the_load_balancing_loss_over_the_group
"""

import torch.distributed as dist

import parallelism_conformance.impls.expert_parallel as _bundled
from parallelism_conformance.impls import *


class ExpertParallelMoE(_bundled.ExpertParallelMoE):
    def _load_balancing_share(self, probabilities, chosen):
        return super()._load_balancing_share(probabilities, chosen) / dist.get_world_size(self.group)
