"""With top_k > 1 only each token's first choice is sent to its expert (the other choices are left out of the dispatch, as a top-1 layer given k = 2 would do), so the output lacks the second expert's share.
targets: test_top_k_routing_and_the_load_balancing_loss_over_the_group
"""

import torch

import parallelism_conformance.impls.expert_parallel as _bundled
from parallelism_conformance.impls import *


class ExpertParallelMoE(_bundled.ExpertParallelMoE):
    def forward(self, x):
        probabilities = torch.softmax(self.router(x), dim=-1)
        gates, chosen = probabilities.topk(self.top_k, dim=-1)
        if self.compute_aux_loss:
            self.aux_loss = self._load_balancing_share(probabilities, chosen)
        return self._dispatch(x, chosen[:, 0]) * gates[:, :1]
