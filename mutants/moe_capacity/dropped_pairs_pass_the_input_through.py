"""A dropped pair adds the token itself, times its gate, as if the residual connection were inside the layer: the block then adds the token twice.
targets: test_a_capacity_drops_each_members_lowest_gates_and_nothing_else
"""

import torch

import parallelism_conformance.impls.expert_parallel as _bundled
from parallelism_conformance.impls import *


class ExpertParallelMoE(_bundled.ExpertParallelMoE):
    def forward(self, x):
        y = super().forward(x)
        if self.capacity_factor is None or x.shape[0] == 0:
            return y
        probabilities = torch.softmax(self.router(x), dim=-1)
        gates, chosen = probabilities.topk(self.top_k, dim=-1)
        dropped = ~self._kept(chosen.reshape(-1), gates.detach().reshape(-1), x.shape[0]).reshape(chosen.shape)
        return y + (gates * dropped).sum(-1, keepdim=True) * x
