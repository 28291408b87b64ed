"""The MoE layer returns the expert's output without scaling it by the router's gate probability p_e.
targets: test_expert_parallel_moe_equals_one_process_with_every_expert
"""

import torch

from parallelism_conformance.impls import *
from parallelism_conformance.impls.expert_parallel import ExpertParallelMoE as _Correct


class ExpertParallelMoE(_Correct):
    def forward(self, x):
        y = super().forward(x)
        gate = torch.softmax(self.router(x), dim=-1).max(dim=-1).values.detach()
        return y / gate.unsqueeze(-1)
