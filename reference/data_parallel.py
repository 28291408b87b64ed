"""Single-process truth for data parallelism: k optimizer steps on the whole global batch.

Data parallelism on n ranks: rank r keeps the whole model and takes rows [r B/n, (r+1) B/n) of a
global batch of B samples; its loss L_r is the mean over its B/n samples; after backward the
gradients are averaged over ranks, g = (1/n) sum_r grad L_r; every rank applies the same update.
With equal slices, (1/n) sum_r L_r = (1/B) sum_i l_i = L, the loss of the global batch, so

    g = (1/n) sum_r grad L_r = grad L,

and n ranks that start from rank 0's state follow exactly the trajectory of one process training
on the global batch, which is what ``train`` computes (up to rounding: the sums are taken in a
different order; see ``atol``). Torch semantics throughout: a parameter that no forward touched
keeps .grad None after zero_grad(set_to_none=True) and the optimizer skips it (no momentum, no
weight decay); a frozen parameter (requires_grad=False) never changes.

Never imports torch.distributed.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reference.tolerance import unit_roundoff

# The tolerance constant C of ``atol``; see there.
ATOL_FACTOR = 512


@dataclass
class Trajectory:
    """What one process training on the global batch goes through, step s = 0 .. k-1."""

    initial: dict[str, Tensor]  # every parameter and buffer before the first step
    states: list[dict[str, Tensor]]  # every parameter and buffer after step s
    grads: list[dict[str, Tensor]]  # the gradient step s applied, for parameters that had one
    losses: list[Tensor]  # the global-batch loss at step s (the state before the step)
    slice_losses: list[list[Tensor]]  # the loss of rank r's slice at step s (same state)


def split_batch(batch: dict[str, Tensor], world_size: int) -> list[dict[str, Tensor]]:
    """Rank r's slice of a global batch: rows [r B/n, (r+1) B/n) of every tensor. Raises ValueError
    when B is not a multiple of n: the mean of per-rank mean losses is the global mean only when
    the slices are equal."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    sizes = {name: t.shape[0] for name, t in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"the tensors of a batch must share their first (batch) dimension, got {sizes}")
    total = next(iter(sizes.values()))
    if total % world_size:
        raise ValueError(
            f"a global batch of {total} samples does not split evenly across world size {world_size} "
            f"({total} % {world_size} = {total % world_size}): data parallelism needs equal per-rank "
            f"slices for the mean of per-rank mean losses to be the global-batch mean")
    each = total // world_size
    return [{name: t[r * each:(r + 1) * each] for name, t in batch.items()} for r in range(world_size)]


def optimizer(spec: dict, params) -> torch.optim.Optimizer:
    """``{"name": "sgd", "lr", "momentum", "weight_decay"}``: torch.optim.SGD;
    ``{"name": "adamw", "lr", "betas", "eps", "weight_decay"}``: torch.optim.AdamW."""
    kwargs = {k: (tuple(v) if k == "betas" else v) for k, v in spec.items() if k != "name"}
    classes = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
    if spec["name"] not in classes:
        raise ValueError(f"unknown optimizer {spec['name']!r} (known: {', '.join(classes)})")
    return classes[spec["name"]](params, **kwargs)


def state(model: nn.Module) -> dict[str, Tensor]:
    """{name: copy} of every parameter (a tied one once, under its first name) and buffer."""
    return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def train(model: nn.Module, optimizer_spec: dict, batch: dict[str, Tensor], steps: int,
          world_size: int = 1) -> Trajectory:
    """``steps`` optimizer steps of ``model`` (trained in place) on the whole ``batch``:
    zero_grad(set_to_none=True); loss = model(inputs, targets), the global-batch mean;
    loss.backward(); optimizer.step(). Also records, before each step, the loss each of
    ``world_size`` ranks sees on its slice (computed on a copy: forward may update buffers)."""
    opt = optimizer(optimizer_spec, model.parameters())
    slices = split_batch(batch, world_size)
    trajectory = Trajectory(state(model), [], [], [], [])
    for _ in range(steps):
        with torch.no_grad():
            trajectory.slice_losses.append(
                [copy.deepcopy(model)(s["inputs"], s["targets"]).detach() for s in slices])
        opt.zero_grad(set_to_none=True)
        loss = model(batch["inputs"], batch["targets"])
        loss.backward()
        trajectory.grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()
                                 if p.grad is not None})
        opt.step()
        trajectory.losses.append(loss.detach())
        trajectory.states.append(state(model))
    return trajectory


def atol(expected: Tensor, step: int) -> Tensor:
    """How far an implementation's value may sit from ``expected`` after ``step`` steps (1-based):

        atol = C * u * step * max_j |expected_j|    (normwise, one bound for the whole tensor)

    with u the dtype's unit roundoff and C = ATOL_FACTOR = 512 (about 256 eps). Data parallelism
    sums each gradient in a different order (per-rank means, then a mean over ranks) than one
    process does, which perturbs every step's gradient by O((B + n) u) relative to the sizes of the
    summands (Higham, 2nd ed., §4.2); the optimizer turns that into a parameter error of the same
    relative order (AdamW's g / (sqrt(v) + eps) amplifies it by at most 1 / (4 eps) near |g| = eps,
    which is why the suite's AdamW uses eps = 1e-4), and the errors of successive steps add up,
    hence the factor ``step``. Measured with correct implementations the error stays below about
    1/20 of this bound; the bugs it must catch (summing instead of averaging, a missed gradient, a
    missing broadcast) are orders of magnitude larger. Integer tensors must match exactly (0)."""
    if not expected.is_floating_point():
        return torch.zeros((), dtype=torch.float64)
    scale = expected.detach().abs().max().to(torch.float64) if expected.numel() else torch.zeros((), dtype=torch.float64)
    return ATOL_FACTOR * unit_roundoff(expected.dtype) * step * scale + torch.finfo(expected.dtype).tiny
