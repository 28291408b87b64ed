"""Bug: routing, gate value included, runs under torch.no_grad(), so the gate is a constant in backward
verdict: fail
capability: expert_parallel

The argmax is not differentiable, and the engineer wrapped the whole routing step (router,
softmax, argmax and the gathered gate probability) in torch.no_grad() to save memory. The forward
output is exactly right, so a loss comparison passes, and the expert gradients are right too
(they scale by the gate value, which is still correct); but the router gets no gradient at all
(.grad stays None), and dL/dx misses the term that flows through the router into the gate.
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
        with torch.no_grad():                          # routing is a discrete decision
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

        local_ids = torch.repeat_interleave(torch.arange(le).repeat(n), table.reshape(-1))
        perm = torch.argsort(local_ids, stable=True)
        grouped = recv.index_select(0, perm)
        per_expert = table.sum(dim=0).tolist()
        # every local expert runs, on zero rows if none reached it: the return exchange then stays
        # in the autograd graph on every rank, so every rank joins its backward
        outs = [self.experts[j](rows) for j, rows in enumerate(grouped.split(per_expert, dim=0))]
        grouped_out = torch.cat(outs, dim=0)
        recv_out = grouped_out.index_select(0, torch.argsort(perm))

        y_sorted = _AllToAll.apply(recv_out, send_splits, recv_splits, self.group)
        y = y_sorted.index_select(0, torch.argsort(order))
        return y * gate[:, None]


class ExpertParallelMoE:
    """Top-1 mixture of experts, E/n experts per rank; tokens travel by all-to-all with unequal splits."""

    @classmethod
    def from_dense(cls, router, experts, group=None):
        return _ExpertParallelMoE(router, list(experts), group)
