"""The router's logits are centred by their mean over the group's whole batch before the softmax (a batch statistic, all-reduced over the expert-parallel group), so a token's routing and output depend on the other members' tokens (Megatron-Bridge#4635: logits that depend on other EP ranks' samples).
targets: test_top_k_routing_and_the_load_balancing_loss_over_the_group
"""

import torch

import parallelism_conformance.impls.expert_parallel as _bundled
from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives


class _Centred(torch.nn.Module):
    def __init__(self, router, group):
        super().__init__()
        self.router, self.group = router, group

    @property
    def weight(self):
        return self.router.weight

    def forward(self, x):
        logits = self.router(x)
        sums = torch.cat([logits.detach().sum(0), torch.tensor([float(x.shape[0])], dtype=logits.dtype)])
        collectives.all_reduce(sums, group=self.group)
        return logits - sums[:-1] / sums[-1].clamp(min=1)


class ExpertParallelMoE(_bundled.ExpertParallelMoE):
    @classmethod
    def from_dense(cls, router, experts, group=None, top_k=1, compute_aux_loss=False):
        layer = super().from_dense(router, experts, group, top_k, compute_aux_loss)
        layer.router = _Centred(layer.router, group)
        return layer
