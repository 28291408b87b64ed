"""Single-process truth for a compute dtype in fully sharded data parallelism (the CS336 2026
handout's ``compute_dtype``, FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``).

With compute dtype d, rank r casts every trainable parameter (the master, in the model's dtype m)
to d, runs its slice's forward and backward in d, and gets its gradient g_r in d; the ranks
average, g = (1/n) sum_r g_r, and .grad holds g in m (summed over the micro-batches of the step);
the optimizer updates the masters in m. ``rank_terms`` emulates one rank exactly as the handout's
own test does (``_apply_mixed_precision_hooks``: the weights cast to d for forward and backward,
the gradient brought back to m), on a copy of the model.

Examples are chosen so that nothing a rank computes in d can round. On the ``relu_lm`` model
(harness/rank/models.py: integer weights in {-1, 0, 1}, ReLU, a loss linear in the logits,
averaged over P positions, P a power of two) every forward value is an integer and every gradient
an integer multiple of 1/P. A sum of such multiples is exact in any order when the sum of the
magnitudes of its terms stays within 2^p multiples, p the significand's bits (11 for float16, 8
for bfloat16): every partial sum is then representable. ``check_exact`` computes those magnitude
sums for every product, sum and gradient of the forward and backward (the same network on |W|,
where no term can cancel: Higham, 2nd ed., §3.5, the bound |fl(AB) - AB| <= gamma_k |A||B|
vanishes when |A||B| is exact) and for the sum over ranks, and refuses an example that exceeds
2^p. Then rank r's gradient is the exact one, whatever the kernels and summation order.

The only roundings left are the implementation's average over ranks (a division by n, possibly
split in two as FSDP2 does, in d or in m), the accumulation over micro-batches, and the optimizer's
step in m. ``master_atol`` bounds them, each rounding by u times the magnitude it rounds (Higham
§2.2, the standard model; u = unit roundoff): ``reference.tolerance.reduction_atol`` for the
average, (k - 1) u_d for the accumulation of k micro-batches (in d at worst), and one u_m each for
the weight decay's sum and the update p - lr g (lr and the weight decay are powers of two, so their
products are exact). With n a power of two every term but the last vanishes and the bound is one
rounding in m.

Never imports torch.distributed.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from parallelism_conformance.reference.tolerance import reduction_atol, unit_roundoff


@dataclass
class OneStep:
    """One optimizer step of the ranks, in compute dtype ``dtype``, from the masters ``initial``."""

    losses: list[Tensor]  # per rank: its slice loss of each micro-batch, shape (k,), in float32
    initial: dict[str, Tensor]  # the masters before the step (model dtype)
    after: dict[str, Tensor]  # the exact masters after the step, float64
    atol: dict[str, Tensor]  # |implementation - after| allowed, float64 (``master_atol``)


def significand_bits(dtype: torch.dtype) -> int:
    """p: the integers up to 2^p are exact in ``dtype`` (11 for float16, 8 for bfloat16)."""
    return 1 - round(math.log2(torch.finfo(dtype).eps))  # eps = 2^(1 - p)


def in_compute_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` whose trainable floating parameters are cast to ``dtype`` (tied ones
    stay one parameter): what a rank computes with between the all-gather and the reduction."""
    replica = copy.deepcopy(model)
    cast: dict[int, nn.Parameter] = {}
    for owner in replica.modules():
        for name, parameter in list(owner.named_parameters(recurse=False)):
            if parameter.requires_grad and parameter.is_floating_point():
                if id(parameter) not in cast:
                    cast[id(parameter)] = nn.Parameter(parameter.detach().to(dtype))
                owner._parameters[name] = cast[id(parameter)]
    return replica


def rank_terms(model: nn.Module, micro_batches: list[dict[str, Tensor]], dtype: torch.dtype) -> tuple[Tensor, list[dict[str, Tensor]]]:
    """One rank's step in compute dtype ``dtype``: its loss of each of its micro-batch slices and,
    for each, the gradient in ``dtype`` of every trainable parameter (named as in ``model``)."""
    replica = in_compute_dtype(model, dtype)
    named = [(name, p) for name, p in replica.named_parameters() if p.requires_grad]
    losses, grads = [], []
    for batch in micro_batches:
        loss = replica(batch["inputs"], batch["targets"])
        found = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        losses.append(loss.detach())
        grads.append({name: g if g is not None else torch.zeros_like(p) for (name, p), g in zip(named, found)})
    return torch.stack(losses), grads


def magnitudes(model: nn.Module, batch: dict[str, Tensor]) -> tuple[float, dict[str, Tensor]]:
    """For the ``relu_lm`` model: the largest sum of term magnitudes of any forward value (in units
    of 1), and per parameter the sums of the magnitudes of its gradient's terms (in units of 1/P,
    P the batch's positions), both from the network on |W|, in float64."""
    if not hasattr(model, "fc2"):
        raise ValueError(f"exact low-precision examples are built on the relu_lm model, got {type(model).__name__}")
    w = {name: p.detach().abs().double() for name, p in model.named_parameters()}
    embed, w1, w2, head = w["embed.weight"], w["fc1.weight"], w["fc2.weight"], w.get("head.weight", w["embed.weight"])
    tokens, targets = batch["inputs"].reshape(-1), batch["targets"].reshape(-1)
    a0 = embed[tokens]
    a1 = a0 @ w1.T
    a2 = a1 @ w2.T
    a3 = a2 @ head.T
    upstream = torch.zeros_like(a3)
    upstream[torch.arange(len(targets)), targets] = 1.0  # |dL/dlogits| in units of 1/P
    grads = {"head": upstream.T @ a2}
    b2 = upstream @ head
    grads["fc2.weight"] = b2.T @ a1
    b1 = b2 @ w2
    grads["fc1.weight"] = b1.T @ a0
    b0 = b1 @ w1
    embedding = torch.zeros_like(embed).index_add_(0, tokens, b0)
    backward = max(float(t.max()) for t in (b0, b1, b2)) if len(tokens) else 0.0
    if "head.weight" in w:
        grads["head.weight"], grads["embed.weight"] = grads.pop("head"), embedding
    else:  # tied: the embedding's gradient is the sum of both uses
        grads["embed.weight"] = embedding + grads.pop("head")
    forward = max(float(t.max()) for t in (a0, a1, a2, a3)) if len(tokens) else 0.0
    return max(forward, backward), grads


def check_exact(model: nn.Module, per_rank: list[list[dict[str, Tensor]]], dtype: torch.dtype) -> None:
    """Raise ValueError unless every value the ranks compute in ``dtype`` is exact in any order
    (the module docstring): ``per_rank[r][j]`` is rank r's slice of micro-batch j, every slice with
    the same power-of-two count of positions."""
    limit = 2.0 ** significand_bits(dtype)
    positions = {slice_["targets"].numel() for slices in per_rank for slice_ in slices}
    if len(positions) != 1 or not _power_of_two(next(iter(positions))):
        raise ValueError(f"exact examples need every slice to hold the same power-of-two count of positions, got {sorted(positions)}")
    for j in range(len(per_rank[0])):
        summed: dict[str, Tensor] = {}
        for slices in per_rank:
            largest, grads = magnitudes(model, slices[j])
            if largest > limit:
                raise ValueError(f"not exact in {dtype}: a value of micro-batch {j} sums {largest:g} > 2^{significand_bits(dtype)} units")
            for name, g in grads.items():
                summed[name] = summed.get(name, 0) + g
        largest = max(float(g.max()) for g in summed.values())
        if largest > limit:
            raise ValueError(
                f"not exact in {dtype}: the sum over ranks of a gradient of micro-batch {j} sums "
                f"{largest:g} > 2^{significand_bits(dtype)} units"
            )


def one_step(
    model: nn.Module, optimizer: dict, per_rank: list[list[dict[str, Tensor]]], dtype: torch.dtype, micro_batch_scale: float = 1.0
) -> OneStep:
    """The ranks' first optimizer step in compute dtype ``dtype`` (``per_rank[r][j]``: rank r's slice
    of micro-batch j), for SGD (``{"name": "sgd", "lr", "momentum", "weight_decay"}``, lr and the
    weight decay powers of two or zero): the first step's momentum buffer is the gradient itself, so
    p' = p - lr (g + wd p), g = s sum_j (1/n) sum_r g_rj, computed exactly in float64. ``s``
    (``micro_batch_scale``) is 1, or 1/k for a library that divides each of the k micro-batches' losses
    by k (DeepSpeed's gradient_accumulation_steps), a power of two so that the scaled loss stays exact."""
    if optimizer["name"] != "sgd" or not all(_power_of_two(optimizer[k]) or optimizer[k] == 0 for k in ("lr", "weight_decay")):
        raise ValueError(f"the exact one-step reference takes SGD with lr and weight decay powers of two, got {optimizer}")
    if not _power_of_two(micro_batch_scale):
        raise ValueError(f"the exact one-step reference scales the micro-batches by a power of two, got {micro_batch_scale}")
    check_exact(model, per_rank, dtype)
    n, lr, decay = len(per_rank), optimizer["lr"], optimizer["weight_decay"]
    terms = [rank_terms(model, slices, dtype) for slices in per_rank]
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    master = next(iter(initial.values())).dtype
    after, atol = {}, {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            after[name], atol[name] = p.detach().double(), torch.zeros(p.shape, dtype=torch.float64)
            continue
        per_micro = [[grads[j][name] for _, grads in terms] for j in range(len(per_rank[0]))]
        averages = [micro_batch_scale * sum(g.double() for g in gs) / n for gs in per_micro]
        error = sum(reduction_atol(gs, "AVG") for gs in per_micro)
        k = len(per_micro)
        error = error + (k - 1) * unit_roundoff(dtype) * sum(a.abs() for a in averages) * (1 + 2 * unit_roundoff(dtype))
        gradient = sum(averages) + decay * p.detach().double()
        error = error + unit_roundoff(master) * (gradient.abs() + error)
        after[name] = p.detach().double() - lr * gradient
        atol[name] = lr * error + unit_roundoff(master) * (after[name].abs() + lr * error) + torch.finfo(master).tiny
    return OneStep([losses for losses, _ in terms], initial, after, atol)


def _power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5
