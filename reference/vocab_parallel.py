"""Single-process truth for the vocabulary split across a group (Megatron-LM, Shoeybi et al. 2019,
section 3): the input embedding's table split by rows, and the output layer's logits split along the
vocabulary with the loss computed without gathering them.

The embedding: the table [V, d] padded with zero rows to V_pad rows, rank r holding rows
[r V_pad / n, (r + 1) V_pad / n); the output is the dense lookup W[t] exactly (one rank contributes
a row, the others zeros), and the gradient of row v is the sum of the upstream gradients of the
tokens equal to v (zero for the padding rows).

With a vocabulary of V entries on n ranks, the vocabulary is padded to V_pad = n ceil(V / n) and
rank r holds the logit columns [r V_pad / n, (r + 1) V_pad / n); the columns >= V are padding and
never reach the loss. Per token, with z the logits of the V real entries and t the target,

    loss = log sum_j exp(z_j) - z_t = m + log sum_j exp(z_j - m) - z_t,   m = max_j z_j,

which the ranks get from one max (all-reduce MAX), one sum of exp (all-reduce SUM) and the target's
logit (held by one rank: all-reduce SUM of it or zero). Its gradient with respect to z is
softmax(z) - onehot(t), times the upstream gradient of the token; zero in the padding columns.

With label smoothing eps (Szegedy et al. 2016, sec. 7, as torch's ``F.cross_entropy``), the
target distribution is (1 - eps) onehot(t) + eps / V over the V real columns, so

    loss = lse(z) - (1 - eps) z_t - eps mean_j z_j,   gradient softmax(z) - (1 - eps) onehot(t) - eps / V,

the mean over the V real columns of the whole vocabulary (never a rank's own columns, nor the
padding). Megatron's convention (ε / (V - 1) on each other class, target 1 - ε) is this one at
eps (V - 1) / V.

Tolerance: log-sum-exp evaluated in another order errs by about (V + 4) u (|m| + 1) (Higham,
2nd ed., §4.2 for the sum of V positive terms, each exp and the log one u); the gradient, a
softmax, by (V + 4) u per element times the upstream gradient. Computed in float64 from the values
given; results in their dtype. Never imports torch.distributed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from parallelism_conformance.reference.tolerance import unit_roundoff


def padded_vocabulary(vocab: int, n: int) -> int:
    """V_pad = n ceil(V / n): the vocabulary padded so that every rank holds as many columns."""
    if vocab < 1 or n < 1:
        raise ValueError(f"the vocabulary and the group size must be at least 1, got {vocab} and {n}")
    return n * math.ceil(vocab / n)


def embedding(weight: Tensor, tokens: Tensor, grad_output: Tensor) -> dict[str, Tensor]:
    """The dense lookup W[tokens] and, for the upstream gradient [..., d], the table's gradient
    [V, d]: each row the sum of its tokens' upstream gradients, in float64. Keys: output, grad_weight."""
    grad = torch.zeros(weight.shape, dtype=torch.float64)
    grad.index_add_(0, tokens.reshape(-1), grad_output.reshape(-1, weight.shape[1]).double())
    return {"output": weight[tokens], "grad_weight": grad.to(weight.dtype)}


def padded_rows(table: Tensor, n: int, index: int) -> Tensor:
    """Rank ``index``'s rows of ``table`` [V, ...] padded with zero rows to V_pad."""
    each = -(-table.shape[0] // n)
    padded = table.new_zeros((each * n, *table.shape[1:]))
    padded[: table.shape[0]] = table
    return padded[index * each : (index + 1) * each].clone()


def logits_shard(logits: Tensor, n: int, index: int) -> Tensor:
    """Rank ``index``'s columns of the padded logits [..., V_pad] (a copy)."""
    each = logits.shape[-1] // n
    return logits[..., index * each : (index + 1) * each].clone()


def cross_entropy(logits: Tensor, targets: Tensor, vocab: int, grad_output: Tensor, label_smoothing: float = 0.0) -> dict[str, Tensor]:
    """Per-token losses over the first ``vocab`` columns of the padded ``logits`` [..., V_pad], with
    ``label_smoothing`` eps spread over those columns, and the gradient with respect to all of them
    for the upstream gradient ``grad_output`` [...] (zero in the padding columns). Keys: loss,
    grad_logits."""
    z = logits.detach().double().requires_grad_(True)
    real = z[..., :vocab].reshape(-1, vocab)
    loss = F.cross_entropy(real, targets.reshape(-1), reduction="none", label_smoothing=label_smoothing)
    loss = loss.reshape(targets.shape)
    (grad,) = torch.autograd.grad(loss, z, grad_output.double())
    return {"loss": loss.detach().to(logits.dtype), "grad_logits": grad.to(logits.dtype)}


def cross_entropy_atol(logits: Tensor, vocab: int, grad_output: Tensor) -> dict[str, Tensor]:
    """Elementwise bounds for ``cross_entropy``'s results (the module docstring), float64."""
    u = unit_roundoff(logits.dtype)
    real = logits[..., :vocab].double()
    top = real.abs().amax(dim=-1)
    loss = (vocab + 4) * u * (top + 1.0) + torch.finfo(logits.dtype).tiny
    grad = ((vocab + 4) * u * grad_output.double().abs()).unsqueeze(-1).expand(logits.shape)
    return {"loss": loss, "grad_logits": grad + torch.finfo(logits.dtype).tiny}
