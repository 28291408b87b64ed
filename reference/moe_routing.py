"""Single-process truth for a mixture-of-experts layer as it is trained: top-k routing and the
load-balancing auxiliary loss over the whole batch of the expert-parallel group, forward and
backward by plain autograd over every member's tokens at once.

For a token x, router weight W_r [E, h], p = softmax(x W_r^T), and its k chosen experts
e_1 .. e_k (the k largest p_j, the larger first; ties never drawn):

    y = sum_{i<=k} p_{e_i} E_{e_i}(x)          (gates not renormalised: k = 1 is the Switch layer)

The load-balancing loss (Switch Transformer, Fedus et al. 2022, eq. 4, with GShard's top-k
counting) over the T tokens of every member of the group:

    L_aux = E * sum_j f_j P_j,   f_j = (1 / (k T)) #{(token, i): e_i = j},   P_j = (1 / T) sum_tokens p_j

f is a count (no gradient); P carries the router's gradient. Over the group's batch, not a member's:
each member holding T_r tokens would otherwise balance its own tokens only, and a loss averaged over
the members again divides the router's gradient by n (Megatron-LM#3672). The member's share, what
its backward sees, is L_aux restricted to its tokens' terms of P; the shares add up to L_aux.

A capacity (``capacity_factor`` c; GShard, Lepikhin et al. 2021, sec. 2.2; Switch, sec. 2.2): each
member keeps, per expert, at most C_r = ceil(c k T_r / E) of its own (token, choice) pairs routed
there, those of the largest gate probability (ties: the earlier token, then the earlier choice);
the others are dropped: they add nothing to y (the token passes through the residual connection,
outside the layer) and no gradient. The capacity is per member, counted on its own tokens, so a
member's outputs still depend on its own tokens only. f counts the routed pairs, dropped or not.

What is judged in the driver, with the upstream gradients G_r and the loss
L = sum_r sum(Y_r * G_r) + alpha L_aux:

* each member's outputs and input gradients (its own tokens: each a function of itself, so
  changing another member's tokens changes them by nothing: Megatron-Bridge#4635);
* the sum over members of their router gradients (the router is replicated: a data-parallel
  wrapper sums them), dL/dW_r;
* each expert's gradients, over every (token, choice) routed to it from every member;
* the sum over members of their aux_loss, L_aux.

Computed in float64. Never imports torch.distributed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from parallelism_conformance.reference.expert_parallel import _expert


def choose(x: Tensor, router_weight: Tensor, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(probabilities [T, E], chosen experts [T, k], their gates [T, k])."""
    probabilities = torch.softmax(x @ router_weight.T, dim=-1)
    gates, experts = probabilities.topk(top_k, dim=-1)
    return probabilities, experts, gates


def topk_gap(x: Tensor, router_weight: Tensor, top_k: int) -> float:
    """The smallest gap between a token's k-th and (k+1)-th router logits, and between its chosen
    ones (inf where there is nothing to order): where it is within rounding, rounding decides."""
    logits = x.to(torch.float64) @ router_weight.to(torch.float64).T
    if logits.shape[0] == 0 or logits.shape[-1] < 2:
        return float("inf")
    ordered = logits.sort(dim=-1, descending=True).values
    last = min(top_k + 1, logits.shape[-1])
    return float((ordered[:, : last - 1] - ordered[:, 1:last]).min())


def capacity(capacity_factor: float, top_k: int, tokens: int, num_experts: int) -> int:
    """C_r = ceil(c k T_r / E): the pairs a member may send to one expert."""
    return math.ceil(capacity_factor * top_k * tokens / num_experts)


def kept(experts: Tensor, gates: Tensor, num_experts: int, capacity_factor: float | None) -> Tensor:
    """Which of one member's (token, choice) pairs ([T, k]) its capacity keeps (all without one):
    per expert the C_r of the largest gate, ties to the earlier pair in token-major order."""
    if capacity_factor is None:
        return torch.ones_like(experts, dtype=torch.bool)
    tokens, top_k = experts.shape
    limit = capacity(capacity_factor, top_k, tokens, num_experts)
    flat_experts, flat_gates = experts.reshape(-1), gates.detach().reshape(-1)
    keep = torch.zeros(flat_experts.shape, dtype=torch.bool)
    for j in range(num_experts):
        pairs = (flat_experts == j).nonzero().squeeze(-1).tolist()
        pairs.sort(key=lambda pair: (-float(flat_gates[pair]), pair))
        keep[pairs[:limit]] = True
    return keep.reshape(experts.shape)


def capacity_gap(tokens: list[Tensor], router_weight: Tensor, top_k: int, capacity_factor: float | None) -> float:
    """The smallest gap, per member and expert, between the last kept pair's gate and the first
    dropped one's (inf where nothing is dropped): where it is within rounding, rounding decides."""
    if capacity_factor is None:
        return float("inf")
    gap = float("inf")
    for x in tokens:
        if x.shape[0] == 0:
            continue
        _, experts, gates = choose(x.to(torch.float64), router_weight.to(torch.float64), top_k)
        limit = capacity(capacity_factor, top_k, x.shape[0], router_weight.shape[0])
        for j in range(router_weight.shape[0]):
            mine = gates[experts == j].sort(descending=True).values
            if mine.numel() > limit > 0:
                gap = min(gap, float(mine[limit - 1] - mine[limit]))
    return gap


def moe(
    tokens: list[Tensor],
    router_weight: Tensor,
    experts: list[tuple[Tensor, Tensor, Tensor, Tensor]],
    grads: list[Tensor],
    top_k: int,
    aux_weight: float,
    capacity_factor: float | None = None,
) -> dict:
    """``tokens[r]`` [T_r, h], ``grads[r]`` its upstream gradient; ``experts[j]`` = (W1, b1, W2, b2).
    ``capacity_factor``: each member's pairs beyond its capacity dropped (module docstring).
    Returns {"outputs": [Y_r], "grad_inputs": [dL/dX_r], "grad_router": dL/dW_r (every member's
    tokens and the aux loss), "grad_experts": [per expert], "aux_loss": L_aux}."""
    router = router_weight.detach().clone().requires_grad_(True)
    params = [tuple(t.detach().clone().requires_grad_(True) for t in expert) for expert in experts]
    xs = [x.detach().clone().requires_grad_(True) for x in tokens]
    x = torch.cat(xs)
    probabilities, chosen, gates = choose(x, router, top_k)
    keep = torch.cat(
        [
            kept(c, g, router.shape[0], capacity_factor)
            for c, g in zip(chosen.split([len(t) for t in tokens]), gates.split([len(t) for t in tokens]))
        ]
    )
    y = torch.zeros_like(x)
    for i in range(top_k):
        for j, p in enumerate(params):
            rows = ((chosen[:, i] == j) & keep[:, i]).nonzero().squeeze(-1)
            if rows.numel():
                y = y.index_add(0, rows, gates[rows, i, None] * _expert(x[rows], *p))
    total = x.shape[0]
    num_experts = router.shape[0]
    if total:
        f = F.one_hot(chosen, num_experts).sum((0, 1)).to(x.dtype) / (top_k * total)
        aux = num_experts * (f * probabilities.mean(0)).sum()
    else:
        aux = router.sum() * 0
    loss = (y * torch.cat(grads)).sum() + aux_weight * aux
    if loss.requires_grad:
        loss.backward()
    zeros = torch.zeros_like
    return {
        "outputs": list(y.detach().split([len(t) for t in tokens])),
        "grad_inputs": [t.grad if t.grad is not None else zeros(t) for t in xs],
        "grad_router": router.grad if router.grad is not None else zeros(router),
        "grad_experts": [tuple(t.grad.detach() if t.grad is not None else zeros(t) for t in p) for p in params],
        "aux_loss": aux.detach(),
    }
