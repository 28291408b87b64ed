"""Expert parallelism: a top-k mixture-of-experts layer whose experts are split across ranks
(Switch Transformer, Fedus, Zoph and Shazeer 2022, sec. 2.1 and 2.2; GShard, Lepikhin et al. 2021).
Every token reaches its k experts (one row per token and choice, gates not renormalised), unless
``capacity_factor`` c is given: then each member sends an expert at most ceil(c k T_r / E) of its
pairs, those of the largest gate, and the others add nothing. With ``compute_aux_loss`` forward
also sets ``aux_loss``, this member's share of the load-balancing loss over the group's whole batch
(the counts are all-reduced, the probabilities are this member's). With ``sequence_parallel`` the
members' tokens are shards of one sequence (tensor parallelism's sequence-parallel region) and the
router's gradient is all-reduced over the group, whole on every member.

Every rank keeps the router (replicated) and E/n experts, the r-th contiguous block; it routes its
own tokens, p = softmax(x W_r^T), its k experts the k largest p (top-1: the first maximum), one
row per (token, choice), and

1. sorts the rows by expert, so the rows for each rank, and within a rank for each of its experts,
   are contiguous;
2. all-to-all of the per-expert token counts (E/n per destination, equal splits), so each rank
   knows how many tokens it receives from each source for each of its experts;
3. all-to-all of the tokens with unequal splits (the lecture's all-to-all for MoE routing);
4. runs each local expert on the tokens it received for it;
5. all-to-all back with the splits transposed, un-sorts, scales each row by its gate p_e and sums
   each token's k rows.

Backward runs the two token all-to-alls in reverse with their splits transposed (an autograd
Function), so each expert's parameter gradient sums over every token routed to it from every rank,
and each token's input gradient comes home. The router's gradient covers this rank's tokens only
(it is replicated, like any parameter a data-parallel wrapper would then reduce), except under
``sequence_parallel``.

Communication goes through :mod:`impls.collectives` (point-to-point based); torch.distributed is
used for group bookkeeping only.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import collectives


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with unequal splits; backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group, exchange):
        ctx.splits, ctx.group, ctx.exchange = (output_splits, input_splits), group, exchange
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        exchange(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        grad_input = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        ctx.exchange(grad_input, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_input, None, None, None, None


class _SummedGradient(torch.autograd.Function):
    """Megatron's f for a replicated parameter: identity forward, its gradient all-reduced (SUM)
    over the group backward."""

    @staticmethod
    def forward(ctx, weight, group, reduce):
        ctx.group, ctx.reduce = group, reduce
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.reduce(grad, group=ctx.group)
        return grad, None, None


class ExpertParallelMoE(nn.Module):
    """``from_dense(router, experts, group=None)``: ``router`` an nn.Linear(h, E, bias=False) (the
    same on every rank, kept as ``.router``), ``experts`` the E expert modules (the same list on
    every rank); this rank keeps deep copies of its block as ``.experts``. forward(x [T, h]) on
    this rank's tokens returns [T, h]."""

    exchange = staticmethod(collectives.all_to_all_single)
    reduce = staticmethod(collectives.all_reduce)

    def __init__(
        self,
        router: nn.Linear,
        local_experts: list[nn.Module],
        num_experts: int,
        group=None,
        top_k: int = 1,
        compute_aux_loss: bool = False,
        capacity_factor: float | None = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(local_experts)
        self.num_experts = num_experts
        self.group = group
        self.top_k = top_k
        self.compute_aux_loss = compute_aux_loss
        self.capacity_factor = capacity_factor
        self.sequence_parallel = sequence_parallel
        self.aux_loss = None  # with compute_aux_loss: this member's share of the load-balancing loss, set by forward

    @classmethod
    def from_dense(
        cls,
        router: nn.Linear,
        experts,
        group=None,
        top_k: int = 1,
        compute_aux_loss: bool = False,
        capacity_factor: float | None = None,
        sequence_parallel: bool = False,
    ) -> ExpertParallelMoE:
        n, r = dist.get_world_size(group), dist.get_rank(group)
        experts = list(experts)
        if len(experts) != router.out_features:
            raise ValueError(f"the router scores {router.out_features} experts, {len(experts)} were given")
        if len(experts) % n:
            raise ValueError(f"num_experts = {len(experts)} is not divisible by the group size {n}")
        if not 1 <= top_k <= len(experts):
            raise ValueError(f"top_k = {top_k} must be between 1 and num_experts = {len(experts)}")
        each = len(experts) // n
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor = {capacity_factor} must be positive (or None: no capacity)")
        return cls(
            router,
            [copy.deepcopy(e) for e in experts[r * each : (r + 1) * each]],
            len(experts),
            group,
            top_k,
            compute_aux_loss,
            capacity_factor,
            sequence_parallel,
        )

    def _load_balancing_share(self, probabilities: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """E sum_j f_j P_j restricted to this member's tokens' terms of P: f_j the fraction of the
        group's (token, choice) pairs sent to expert j, P_j this member's probabilities summed over
        its tokens over the group's token count (the shares add up to the group's loss)."""
        counts = torch.cat(
            [
                torch.bincount(chosen.reshape(-1), minlength=self.num_experts).double(),
                torch.tensor([float(probabilities.shape[0])], dtype=torch.float64),
            ]
        )
        self.reduce(counts, group=self.group)
        total = counts[-1]
        if total == 0:
            return probabilities.sum() * 0
        f = (counts[:-1] / (self.top_k * total)).to(probabilities.dtype)
        return self.num_experts * (f * probabilities.sum(0) / total.to(probabilities.dtype)).sum()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's logits. Under sequence parallelism the members' tokens are shards of one
        sequence and the router is replicated over the group: its weight goes through f (identity
        forward, all-reduce backward), so every member's router gradient is the whole sequence's
        (torchtitan#2387: left unreduced, the routers diverge after the first step)."""
        if not self.sequence_parallel:
            return self.router(x)
        return F.linear(x, _SummedGradient.apply(self.router.weight, self.group, self.reduce), self.router.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = torch.softmax(self._logits(x), dim=-1)
        gates, chosen = probabilities.topk(self.top_k, dim=-1)  # [T, k]
        if self.compute_aux_loss:  # one all-reduce of E + 1 counts, only when asked for
            self.aux_loss = self._load_balancing_share(probabilities, chosen)
        rows = x.repeat_interleave(self.top_k, dim=0) if self.top_k > 1 else x  # one row per (token, choice)
        experts, gates = chosen.reshape(-1), gates.reshape(-1, 1)
        if self.capacity_factor is None:
            y = self._dispatch(rows, experts) * gates
        else:  # dropped pairs add nothing (the token passes through the residual, outside the layer)
            sent = self._kept(experts, gates.detach().reshape(-1), x.shape[0]).nonzero().squeeze(-1)
            y = torch.zeros_like(rows).index_copy(0, sent, self._dispatch(rows[sent], experts[sent]) * gates[sent])
        return y.reshape(x.shape[0], self.top_k, x.shape[-1]).sum(1) if self.top_k > 1 else y

    def _kept(self, experts: torch.Tensor, gates: torch.Tensor, tokens: int) -> torch.Tensor:
        """Which of this member's (token, choice) pairs, in token-major order, its capacity keeps: per
        expert the ceil(c k T / E) of the largest gate, ties to the earlier pair (a stable sort)."""
        limit = math.ceil(self.capacity_factor * self.top_k * tokens / self.num_experts)
        order = torch.argsort(-gates, stable=True)
        ranked = experts[order]
        place = F.one_hot(ranked, self.num_experts).cumsum(0).gather(1, ranked[:, None]).squeeze(1) - 1
        keep = torch.zeros_like(experts, dtype=torch.bool)
        keep[order] = place < limit
        return keep

    def _dispatch(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Every row of x through its expert, wherever that expert lives, and back in row order."""
        n = dist.get_world_size(self.group)
        each = self.num_experts // n
        order = torch.argsort(expert, stable=True)
        per_expert = torch.bincount(expert, minlength=self.num_experts)  # what I send, by expert
        received_per_expert = torch.empty_like(per_expert)  # [source rank, my expert], flattened
        self.exchange(received_per_expert, per_expert, group=self.group)
        send = per_expert.view(n, each).sum(1).tolist()
        receive = received_per_expert.view(n, each).sum(1).tolist()
        arrived = _AllToAll.apply(x[order], receive, send, self.group, self.exchange)
        pieces = arrived.split(received_per_expert.tolist())  # (source 0: my experts 0..), (source 1: ..)
        done = torch.cat([self.experts[i % each](piece) for i, piece in enumerate(pieces)]) if pieces else arrived
        returned = _AllToAll.apply(done, send, receive, self.group, self.exchange)
        return torch.empty_like(returned).index_copy(0, order, returned)
