"""Correct: top-1 MoE that sorts tokens by expert, swaps per-expert counts, then moves tokens and results with a differentiable point-to-point all-to-all.
verdict: pass
capability: expert_parallel

The router is replicated and applied to this rank's tokens; each token goes to its first-maximum
expert. Tokens are stably sorted by expert, per-expert counts are exchanged so every rank knows what
it will receive and in which order, tokens travel to the owners of their experts, each local expert
runs on its contiguous run of rows, results travel back along the transposed splits and are put
back into the original token order before being scaled by the gate probability. The all-to-all is
an autograd.Function whose backward is the same exchange with the splits transposed.
"""
import torch
import torch.distributed as dist
from torch import nn


def _group_info(group):
    g = group if group is not None else dist.group.WORLD
    n = dist.get_world_size(g)
    me = dist.get_rank(g)
    peers = [dist.get_global_rank(g, r) for r in range(n)]
    return g, n, me, peers


def _exchange(pieces_out, pieces_in, group):
    """pieces_out[j] goes to group rank j; pieces_in[j] is filled from group rank j."""
    g, n, me, peers = _group_info(group)
    reqs = []
    for j in range(n):
        if j == me:
            pieces_in[j].copy_(pieces_out[j])
            continue
        if pieces_in[j].numel() > 0:
            reqs.append(dist.irecv(pieces_in[j], src=peers[j], group=g))
        if pieces_out[j].numel() > 0:
            reqs.append(dist.isend(pieces_out[j].contiguous(), dst=peers[j], group=g))
    for req in reqs:
        req.wait()


def _all_to_all_rows(x, send_counts, recv_counts, group):
    rows_out = list(torch.split(x, send_counts, dim=0))
    out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
    rows_in = list(torch.split(out, recv_counts, dim=0))
    _exchange(rows_out, rows_in, group)
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group):
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        return _all_to_all_rows(x.contiguous(), send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad):
        back = _all_to_all_rows(grad.contiguous(), ctx.recv_counts, ctx.send_counts, ctx.group)
        return back, None, None, None


class ExpertParallelMoE(nn.Module):
    """Top-1 mixture of experts, E/n experts per rank; tokens travel by all-to-all with unequal splits."""

    def __init__(self, router, local_experts, num_experts, group):
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(local_experts)
        self.num_experts = num_experts
        self.group = group

    @classmethod
    def from_dense(cls, router, experts, group=None):
        experts = list(experts)
        num_experts = len(experts)
        _, n, me, _ = _group_info(group)
        if num_experts % n != 0:
            raise ValueError(
                f"num_experts={num_experts} (E) is not divisible by the group size n={n}"
            )
        per_rank = num_experts // n
        return cls(router, experts[me * per_rank:(me + 1) * per_rank], num_experts, group)

    def forward(self, x):
        _, n, me, _ = _group_info(self.group)
        E = self.num_experts
        per_rank = E // n
        T = x.shape[0]

        probs = torch.softmax(self.router(x), dim=-1)
        pmax = probs.max(dim=-1, keepdim=True).values
        ids = torch.arange(E, device=x.device).expand_as(probs)
        expert = torch.where(probs == pmax, ids, torch.full_like(ids, E)).min(dim=-1).values
        gate = probs.gather(-1, expert.unsqueeze(-1))

        order = torch.sort(expert, stable=True).indices
        x_sorted = x[order]
        per_expert = torch.bincount(expert, minlength=E).to(torch.int64)

        counts_out = list(per_expert.view(n, per_rank))
        counts_in = [torch.empty(per_rank, dtype=torch.int64, device=x.device) for _ in range(n)]
        _exchange(counts_out, counts_in, self.group)
        recv_matrix = torch.stack(counts_in).cpu()
        send_counts = per_expert.view(n, per_rank).sum(dim=1).tolist()
        recv_counts = recv_matrix.sum(dim=1).tolist()

        received = _AllToAllRows.apply(x_sorted, send_counts, recv_counts, self.group)

        pieces = list(torch.split(received, recv_matrix.reshape(-1).tolist(), dim=0))
        outputs = [received[:0]]
        for src in range(n):
            for local in range(per_rank):
                rows = pieces[src * per_rank + local]
                if rows.shape[0] > 0:
                    outputs.append(self.experts[local](rows))
        processed = torch.cat(outputs, dim=0)

        returned = _AllToAllRows.apply(processed, recv_counts, send_counts, self.group)
        restore = torch.empty_like(order)
        restore[order] = torch.arange(T, device=x.device)
        return gate * returned[restore]


__all__ = ["ExpertParallelMoE"]
