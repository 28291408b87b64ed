"""Single-process truth for expert parallelism: a top-1 mixture-of-experts layer (Switch
Transformer, Fedus, Zoph and Shazeer 2022, sec. 2.1, without a capacity limit), forward and
backward by plain autograd over every rank's tokens at once.

For a token x (a row of width h), router weight W_r [E, h] and experts E_0 .. E_{E-1}:

    p = softmax(x W_r^T),   e = argmax_j p_j (the first maximum),   y = p_e E_e(x)

with each expert E_j(x) = GELU(x W1_j^T + b1_j) W2_j^T + b2_j (exact GELU). Expert parallelism
over n ranks: rank r holds experts r E/n .. (r+1) E/n - 1 and its own tokens X_r; tokens travel to
their expert's rank and back by two all-to-alls with unequal splits (the lecture's use of
all-to-all). The loss of the check is L = sum_r sum (Y_r * G_r) for given upstream gradients G_r,
so:

* Y_r and dL/dX_r depend on rank r's tokens only (each token is its own function);
* an expert's parameter gradient sums over every token routed to it, from every rank;
* the router is replicated: rank r's dL/dW_r covers its own tokens, sum (Y_r * G_r) (a data-parallel
  wrapper would then reduce it, as for any replicated parameter).

Computed in float64 (the suite draws float64 MoE layers only). Never imports torch.distributed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Tolerance: see ``atol``.
RELATIVE = 1e-9
# Examples whose tokens have two router logits closer than this are not drawn: there the routing, a
# discontinuous choice, would be decided by rounding.
ROUTING_TIE = 1e-6


def check_divisible(num_experts: int, n: int) -> None:
    """Experts split evenly: a ValueError naming num_experts, its value and n otherwise."""
    if num_experts % n:
        raise ValueError(f"num_experts = {num_experts} is not divisible by the group size {n}")


def owner(expert: int, num_experts: int, n: int) -> int:
    """The rank holding ``expert``: experts are split in n contiguous blocks of E/n."""
    return expert // (num_experts // n)


def route(x: Tensor, router_weight: Tensor) -> tuple[Tensor, Tensor]:
    """(expert index, gate probability) of every row of x: argmax and max of softmax(x W_r^T)."""
    probabilities = torch.softmax(x @ router_weight.T, dim=-1)
    gate, expert = probabilities.max(dim=-1)
    return expert, gate


def routed(tokens: list[Tensor], router_weight: Tensor, n: int) -> list[list[int]]:
    """``routed[s][d]``: how many of rank s's tokens have their expert on rank d."""
    counts = [[0] * n for _ in tokens]
    for s, x in enumerate(tokens):
        for expert in route(x, router_weight)[0].tolist():
            counts[s][owner(expert, router_weight.shape[0], n)] += 1
    return counts


def top2_gap(x: Tensor, router_weight: Tensor) -> float:
    """The smallest gap between a token's two largest router logits (inf with one expert): where
    it is within rounding, the routing itself is decided by rounding."""
    logits = x.to(torch.float64) @ router_weight.to(torch.float64).T
    if logits.shape[-1] < 2 or logits.shape[0] == 0:
        return float("inf")
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def _expert(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def moe(tokens: list[Tensor], router_weight: Tensor, experts: list[tuple[Tensor, Tensor, Tensor, Tensor]], grads: list[Tensor]) -> dict:
    """``tokens[r]`` [T_r, h] and ``grads[r]`` (upstream, same shape) per rank; ``experts[j]`` =
    (W1 [f, h], b1 [f], W2 [h, f], b2 [h]). Returns {"outputs": [Y_r], "grad_inputs": [dL/dX_r],
    "grad_router": [rank r's dL/dW_r], "grad_experts": [(dW1, db1, dW2, db2) per expert]}."""
    router = router_weight.detach().clone().requires_grad_(True)
    params = [tuple(t.detach().clone().requires_grad_(True) for t in expert) for expert in experts]
    xs = [x.detach().clone().requires_grad_(True) for x in tokens]
    outputs, grad_router = [], []
    for x, g in zip(xs, grads):
        router.grad = None
        expert_index, gate = route(x, router)
        y = torch.zeros_like(x)
        for j, p in enumerate(params):
            chosen = expert_index == j
            if chosen.any():
                y = y.index_put((chosen.nonzero().squeeze(-1),), gate[chosen, None] * _expert(x[chosen], *p))
        if y.requires_grad:  # a rank with no tokens has nothing to differentiate
            y.backward(g)
        outputs.append(y.detach())
        grad_router.append(router.grad.detach().clone() if router.grad is not None else torch.zeros_like(router))
    zeros = lambda t: torch.zeros_like(t)  # noqa: E731 - an expert no token chose has zero gradients
    return {
        "outputs": outputs,
        "grad_inputs": [x.grad if x.grad is not None else zeros(x) for x in xs],
        "grad_router": grad_router,
        "grad_experts": [tuple(t.grad.detach() if t.grad is not None else zeros(t) for t in p) for p in params],
    }


def atol(expected: Tensor) -> Tensor:
    """RELATIVE (1 + |expected|), elementwise. Every result is at most six nested sums of at most
    K <= 64 terms (h, f, E <= 8; up to 32 tokens summed into an expert's gradient), each erring by
    gamma_K = K u times the sum of the absolute values of its terms (Higham, 2nd ed., sec. 3.1);
    with the drawn scales (N(0,1) tokens and upstream gradients, U(+-1/sqrt(fan_in)) weights) those
    sums stay below 10^3, so in float64 (u = 2^-53) the error is below 6 * 64 * 1.1e-16 * 10^3 <
    5e-11, twenty times under RELATIVE; the bugs the check is for (a token sent to the wrong
    expert, a missing gate, gradients not sent back, counted twice) are O(1)."""
    return RELATIVE * (1 + expected.abs())
