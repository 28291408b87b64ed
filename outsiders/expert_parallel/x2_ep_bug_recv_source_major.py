"""Bug: received tokens are split among local experts as if grouped by expert, but they arrive grouped by source
verdict: fail
capability: expert_parallel

all_to_all_single delivers the rows source-major: everything from source 0 (its rows for local
expert 0, then local expert 1, ...), then everything from source 1. This version skips the
regrouping and cuts the received buffer straight into per-expert pieces sized by the summed
counts, as if the rows were expert-major. With one expert per rank (E = n) or one rank the two
layouts coincide, so the common test setup passes; with E/n >= 2 and two or more sources, rows go
through another local expert, and outputs, dL/dx and the expert gradients are wrong.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _group_info(group):
    g = group if group is not None else dist.group.WORLD
    return g, dist.get_world_size(g), dist.get_rank(g)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.in_splits,
                               input_split_sizes=ctx.out_splits, group=ctx.group)
        return back, None, None, None


class _ExpertParallelMoE(nn.Module):
    def __init__(self, router, experts, group):
        super().__init__()
        g, n, r = _group_info(group)
        E = len(experts)
        if E % n != 0:
            raise ValueError(f"num_experts={E} is not divisible by the group size n={n}")
        self.group = g
        self.n = n
        self.rank = r
        self.num_experts = E
        self.local = E // n
        self.router = copy.deepcopy(router)
        self.experts = nn.ModuleList(copy.deepcopy(experts[i]) for i in range(r * self.local, (r + 1) * self.local))

    def forward(self, x):
        n, E, le = self.n, self.num_experts, self.local
        logits = self.router(x)
        p = F.softmax(logits, dim=-1)
        e = torch.argmax(p, dim=-1)
        gate = p.gather(1, e[:, None]).squeeze(1)

        order = torch.argsort(e, stable=True)
        x_sorted = x.index_select(0, order)
        counts = torch.bincount(e, minlength=E).to(torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send_splits = counts.view(n, le).sum(dim=1).tolist()
        table = recv_counts.view(n, le)                   # [source, local expert]
        recv_splits = table.sum(dim=1).tolist()

        recv = _AllToAll.apply(x_sorted, recv_splits, send_splits, self.group)

        grouped = recv
        per_expert = table.sum(dim=0).tolist()
        # every local expert runs, on zero rows if none reached it: the return exchange then stays
        # in the autograd graph on every rank, so every rank joins its backward
        outs = [self.experts[j](rows) for j, rows in enumerate(grouped.split(per_expert, dim=0))]
        grouped_out = torch.cat(outs, dim=0)
        recv_out = grouped_out

        y_sorted = _AllToAll.apply(recv_out, send_splits, recv_splits, self.group)
        y = y_sorted.index_select(0, torch.argsort(order))
        return y * gate[:, None]


class ExpertParallelMoE:
    """Top-1 mixture of experts, E/n experts per rank; tokens travel by all-to-all with unequal splits."""

    @classmethod
    def from_dense(cls, router, experts, group=None):
        return _ExpertParallelMoE(router, list(experts), group)
