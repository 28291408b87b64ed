"""Correct: each member ranks its own (token, choice) pairs per expert by gate (ties: earlier token, then earlier choice), keeps the first C_r = ceil(c k T_r / E) of each expert before dispatch, and f counts every routed pair.

verdict: pass
capability: moe_capacity

Written from the contract alone, extending the outsider top-k layer (every (token, choice) pair is
its own row, stably sorted by expert, exchanged with all_to_all_single both ways, combined with
index_add by its token). ``from_dense`` checks ``top_k`` (1 <= k <= E), ``capacity_factor`` (None
for no limit, else a real number > 0) and that the group size divides E before building anything,
then keeps a copy of the router and of this member's contiguous block of E / n experts.

The forward computes p = softmax(x W_r^T) on this member's own tokens and picks each token's k
experts by a stable descending sort of p. The pairs are laid out token-major (pair t k + i is token
t's i-th choice). With a capacity factor, the drop decision is made on the member, before anything
is sent: the pairs are stably sorted by gate, descending (so equal gates keep the earlier token,
then the earlier choice), then stably by expert, so each expert's pairs are contiguous and in
priority order; a pair's rank is its position inside its expert's block, and it is kept if that rank
is below C_r = ceil(c k T_r / E), computed exactly (with ``fractions.Fraction``) from this member's
own token count T_r. Without a capacity factor every pair is kept (the moe_topk layer). Only the kept
pairs are dispatched, so a dropped pair adds nothing to y and no gradient reaches its x row, its
gate, or any expert through it.

One all_gather of [all pairs per expert, kept pairs per expert, T_r] gives every member the whole
group's tables: the kept table gives the send/receive splits and the per-source, per-expert layout
of what arrives; the all-pairs table gives f_j (every routed pair, dropped or not, over k T_group);
T_group is the group's token count. The received rows are regrouped expert by expert, run through
the local experts, put back in arrival order and sent back; the returned rows are scaled by their
(not renormalised) gate and added into their token. The exchange Function also takes a dummy leaf
that requires grad, so its backward (a collective) runs on every member.

The aux share of this member is E sum_j f_j (sum of p_j over its own tokens) / T_group: the shares
add up to E sum_j f_j P_j, and since f is a count, each share's gradient reaches the router through
this member's tokens only, so the members' router gradients add up to the dense one. A group with
no token has aux 0 (a zero that still depends on the router, in the layer's dtype).
"""
import copy
import math
import numbers
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn


def _group_size_rank(group):
    return dist.get_world_size(group), dist.get_rank(group)


class _RowExchange(torch.autograd.Function):
    """Rows of ``x`` in blocks of ``send_splits`` go to the group's members in order; the result
    holds ``recv_splits`` rows from each member in order. Backward is the transposed exchange."""

    @staticmethod
    def forward(ctx, x, dummy, send_splits, recv_splits, group):
        ctx.send_splits = send_splits
        ctx.recv_splits = recv_splits
        ctx.group = group
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        grad_in = grad_out.new_empty((sum(ctx.send_splits),) + tuple(grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out, output_split_sizes=ctx.send_splits,
                               input_split_sizes=ctx.recv_splits, group=ctx.group)
        return grad_in, None, None, None, None


def _exchange(x, send_splits, recv_splits, group):
    dummy = torch.zeros((), dtype=x.dtype, device=x.device, requires_grad=True)
    return _RowExchange.apply(x, dummy, list(send_splits), list(recv_splits), group)


def _capacity(capacity_factor, k, T, E):
    """C_r = ceil(c k T_r / E), exactly; None means no limit."""
    if capacity_factor is None:
        return None
    return math.ceil(Fraction(capacity_factor) * k * T / E)


class ExpertParallelMoE(nn.Module):
    def __init__(self, router, local_experts, num_experts, group, top_k, compute_aux_loss,
                 capacity_factor):
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(local_experts)
        self.num_experts = num_experts
        self.group = group
        self.top_k = top_k
        self.compute_aux_loss = compute_aux_loss
        self.capacity_factor = capacity_factor
        self.aux_loss = None

    @classmethod
    def from_dense(cls, router, experts, group=None, top_k=1, compute_aux_loss=False,
                   capacity_factor=None):
        experts = list(experts)
        E = len(experts)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= E:
            raise ValueError(f"top_k must be an integer in [1, num_experts={E}], got top_k={top_k}")
        if capacity_factor is not None:
            if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real)
                    or not math.isfinite(float(capacity_factor)) or not capacity_factor > 0):
                raise ValueError(f"capacity_factor must be a positive number, got "
                                 f"capacity_factor={capacity_factor}")
        n, r = _group_size_rank(group)
        if E % n != 0:
            raise ValueError(f"num_experts={E} is not divisible by the expert-parallel group size "
                             f"n={n}")
        per = E // n
        local = [copy.deepcopy(e) for e in experts[r * per:(r + 1) * per]]
        return cls(copy.deepcopy(router), local, E, group, top_k, compute_aux_loss,
                   capacity_factor)

    def forward(self, x):
        group = self.group
        n, me = _group_size_rank(group)
        E, k = self.num_experts, self.top_k
        per = E // n
        T, h = x.shape

        probs = torch.softmax(self.router(x), dim=-1)                      # [T, E]
        order_e = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices
        choice = order_e[:, :k]                                              # [T, k]
        gates = torch.gather(probs, 1, choice)                               # [T, k]

        pair_expert = choice.reshape(-1)                                     # token-major
        pair_token = torch.arange(T, device=x.device).repeat_interleave(k)
        pair_gate = gates.reshape(-1)
        all_counts = torch.bincount(pair_expert, minlength=E).to(torch.int64)

        # priority: largest gate first, ties to the earlier pair (earlier token, then choice)
        by_gate = torch.sort(pair_gate.detach(), descending=True, stable=True).indices
        perm = by_gate[torch.sort(pair_expert[by_gate], stable=True).indices]  # expert, priority
        sorted_expert = pair_expert[perm]
        cap = _capacity(self.capacity_factor, k, T, E)
        if cap is not None:
            block_start = torch.cumsum(all_counts, 0) - all_counts            # [E]
            rank_in_expert = (torch.arange(perm.numel(), device=x.device)
                              - block_start[sorted_expert])
            perm = perm[rank_in_expert < cap]
            sorted_expert = pair_expert[perm]
        sorted_token = pair_token[perm]

        kept_counts = torch.bincount(sorted_expert, minlength=E).to(torch.int64)
        mine = torch.cat([all_counts, kept_counts,
                          torch.tensor([T], dtype=torch.int64, device=all_counts.device)])
        table = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(table, mine, group=group)
        table = torch.stack(table).cpu()                                     # [n, 2E + 1]
        pair_counts = table[:, :E]                                           # every routed pair
        kept = table[:, E:2 * E]                                             # [src, expert]
        T_group = int(table[:, 2 * E].sum())

        send_splits = [int(kept[me, d * per:(d + 1) * per].sum()) for d in range(n)]
        from_src = kept[:, me * per:(me + 1) * per]                          # [src, local e]
        recv_splits = [int(from_src[j].sum()) for j in range(n)]

        rows = _exchange(x[sorted_token], send_splits, recv_splits, group)

        # arrival order is (source, local expert); regroup as (local expert, source)
        starts = []
        off = 0
        for j in range(n):
            row = []
            for l in range(per):
                row.append(off)
                off += int(from_src[j, l])
            starts.append(row)
        regroup = []
        sizes = []
        for l in range(per):
            size = 0
            for j in range(n):
                c = int(from_src[j, l])
                regroup.extend(range(starts[j][l], starts[j][l] + c))
                size += c
            sizes.append(size)
        regroup = torch.tensor(regroup, dtype=torch.int64, device=x.device)
        by_expert = rows[regroup]
        outs = []
        off = 0
        for l, expert in enumerate(self.experts):
            outs.append(expert(by_expert[off:off + sizes[l]]))
            off += sizes[l]
        expert_out = torch.cat(outs, dim=0) if outs else by_expert
        arrival = torch.empty_like(regroup)
        arrival[regroup] = torch.arange(regroup.numel(), device=x.device)
        back = _exchange(expert_out[arrival], recv_splits, send_splits, group)  # kept pairs

        weighted = back * pair_gate[perm].unsqueeze(1)
        y = torch.zeros(T, h, dtype=back.dtype, device=x.device).index_add(0, sorted_token, weighted)

        if self.compute_aux_loss:
            if T_group == 0:
                self.aux_loss = probs.sum() * 0.0
            else:
                f = pair_counts.sum(0).to(probs.dtype) / float(T_group * k)   # [E], no grad
                P_share = probs.sum(0) / float(T_group)                       # this member's part
                self.aux_loss = E * torch.sum(f.to(probs.device) * P_share)
        return y


__all__ = ["ExpertParallelMoE"]
