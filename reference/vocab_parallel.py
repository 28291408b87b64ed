"""Single-process truth for vocabulary-parallel cross entropy (Megatron-LM, Shoeybi et al. 2019,
section 3: the output embedding's GEMM is split along the vocabulary, and the loss is computed
without gathering the logits).

With a vocabulary of V entries on n ranks, the vocabulary is padded to V_pad = n ceil(V / n) and
rank r holds the logit columns [r V_pad / n, (r + 1) V_pad / n); the columns >= V are padding and
never reach the loss. Per token, with z the logits of the V real entries and t the target,

    loss = log sum_j exp(z_j) - z_t = m + log sum_j exp(z_j - m) - z_t,   m = max_j z_j,

which the ranks get from one max (all-reduce MAX), one sum of exp (all-reduce SUM) and the target's
logit (held by one rank: all-reduce SUM of it or zero). Its gradient with respect to z is
softmax(z) - onehot(t), times the upstream gradient of the token; zero in the padding columns.

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

from reference.tolerance import unit_roundoff


def padded_vocabulary(vocab: int, n: int) -> int:
    """V_pad = n ceil(V / n): the vocabulary padded so that every rank holds as many columns."""
    if vocab < 1 or n < 1:
        raise ValueError(f"the vocabulary and the group size must be at least 1, got {vocab} and {n}")
    return n * math.ceil(vocab / n)


def logits_shard(logits: Tensor, n: int, index: int) -> Tensor:
    """Rank ``index``'s columns of the padded logits [..., V_pad] (a copy)."""
    each = logits.shape[-1] // n
    return logits[..., index * each:(index + 1) * each].clone()


def cross_entropy(logits: Tensor, targets: Tensor, vocab: int, grad_output: Tensor) -> dict[str, Tensor]:
    """Per-token losses over the first ``vocab`` columns of the padded ``logits`` [..., V_pad], and
    the gradient with respect to all of them for the upstream gradient ``grad_output`` [...]
    (zero in the padding columns). Keys: loss, grad_logits."""
    z = logits.detach().double().requires_grad_(True)
    loss = F.cross_entropy(z[..., :vocab].reshape(-1, vocab), targets.reshape(-1), reduction="none")
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
