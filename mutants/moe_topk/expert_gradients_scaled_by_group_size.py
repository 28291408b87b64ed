"""The experts' gradients come out n times too large at expert parallelism n (pytorch#160285: expert gradients 2x at EP=2, the loss curves identical): each expert's gradient is treated like a replicated parameter's sum over the group, as if the tokens of every member had been counted once per member.
targets: test_top_k_routing_and_the_load_balancing_loss_over_the_group
"""

import torch.distributed as dist

import parallelism_conformance.impls.expert_parallel as _bundled
from parallelism_conformance.impls import *


class ExpertParallelMoE(_bundled.ExpertParallelMoE):
    @classmethod
    def from_dense(cls, router, experts, group=None, top_k=1, compute_aux_loss=False):
        layer = super().from_dense(router, experts, group, top_k, compute_aux_loss)
        n = dist.get_world_size(group)
        for p in layer.experts.parameters():
            p.register_hook(lambda grad, n=n: grad * n)
        return layer
