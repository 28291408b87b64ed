"""The MoE layer sends every token to every rank, each keeping those for its own experts: right values and gradients, (n-1) T rows out where only the tokens routed elsewhere need to travel.
targets: test_expert_parallel_traffic
"""

import torch
import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls.expert_parallel import ExpertParallelMoE as _Correct
from parallelism_conformance.impls.expert_parallel import _AllToAll


class ExpertParallelMoE(_Correct):
    def forward(self, x):
        n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        each = self.num_experts // n
        gate, expert = torch.softmax(self.router(x), dim=-1).max(dim=-1)
        order = torch.argsort(expert, stable=True)
        per_expert = torch.bincount(expert, minlength=self.num_experts)
        everyone = torch.empty(n * self.num_experts, dtype=per_expert.dtype)
        self.exchange(everyone, per_expert.repeat(n), group=self.group)
        counts = everyone.view(n, self.num_experts)  # counts[s][e]: tokens of rank s for expert e
        arrived = _AllToAll.apply(x[order].repeat(n, 1), counts.sum(1).tolist(), [x.shape[0]] * n, self.group, self.exchange)
        done = []
        for s, block in enumerate(arrived.split(counts.sum(1).tolist())):
            start = int(counts[s, : r * each].sum())
            for k in range(each):
                length = int(counts[s, r * each + k])
                done.append(self.experts[k](block[start : start + length]))
                start += length
        send = per_expert.view(n, each).sum(1).tolist()
        receive = counts[:, r * each : (r + 1) * each].sum(1).tolist()
        returned = _AllToAll.apply(torch.cat(done), send, receive, self.group, self.exchange)
        y = torch.empty_like(returned).index_copy(0, order, returned)
        return y * gate.unsqueeze(-1)
