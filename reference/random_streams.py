"""Single-process truth for data parallelism with dropout: the masks are drawn from each rank's own
random stream, so one process on the global batch is not the reference; the per-rank forwards are.

Rank r seeds torch's default generator with s(t, r) before its forward of step t and draws its
dropout masks on its own slice. The gradient every rank ends with is the mean of the n slices'
gradients, each under its own masks:

    g_t = (1/n) sum_r grad L_r(theta_t; masks drawn from s(t, r)),

computed here by running the dense model on each slice after seeding the generator the same way
(the masks depend only on the seed and the shape drawn, the slice's). An implementation that
recomputes a forward in backward (activation checkpointing, a fully sharded unit's re-gather) must
replay the same draws, by restoring the generator's state as torch.utils.checkpoint does with
preserve_rng_state=True; one that does not draws new masks for the backward's forward, and the
gradient no longer belongs to the forward's loss (allenai/OLMo-core#828). The driver's own generator
is left as it was (torch.random.fork_rng).

Never imports torch.distributed.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from parallelism_conformance.reference.data_parallel import Trajectory, _bound, optimizer, optimizer_state_numel, state


def dropout_seed(base: int, step: int, rank: int) -> int:
    """s(t, r): the seed rank ``rank`` gives the default generator before its forward of step ``step``."""
    return base + 1009 * step + rank


def loss_atol(loss: Tensor) -> Tensor:
    """A rank's slice loss: the same masks and values, so only the order of summing differs,
    C u |L| (reference/data_parallel.py's C)."""
    return _bound(float(loss.abs()), loss.dtype)


def train(model: nn.Module, optimizer_spec: dict, slices: list[dict[str, Tensor]], steps: int, base_seed: int, device: str = "cpu"):
    """``steps`` optimizer steps of ``model`` (in place) with the gradient g_t above over the ranks'
    ``slices``, each slice's forward on ``device``, the ranks' kind of device: a CUDA rank draws its
    masks from the device's generator (torch.manual_seed seeds both), which only the same kernel on
    the same kind of device replays. Returns (the Trajectory, per step the list of per-rank slice
    losses), on the CPU."""
    opt = optimizer(optimizer_spec, model.parameters())
    trajectory = Trajectory(state(model), [], [], [], [])
    rank_losses = []
    n = len(slices)
    forked = [torch.cuda.current_device()] if device == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        for t in range(steps):
            opt.zero_grad(set_to_none=True)
            grads: dict[str, Tensor] = {}
            losses = []
            for r, part in enumerate(slices):
                torch.manual_seed(dropout_seed(base_seed, t, r))
                replica = copy.deepcopy(model).to(device)
                loss = replica(part["inputs"].to(device), part["targets"].to(device))
                loss.backward()
                losses.append(loss.detach().cpu())
                for name, p in replica.named_parameters():
                    if p.grad is not None:
                        grads[name] = grads.get(name, 0) + p.grad.cpu()
            for name, p in model.named_parameters():
                if name in grads:
                    p.grad = grads[name] / n
            trajectory.grads.append({name: g / n for name, g in grads.items()})
            opt.step()
            trajectory.losses.append(torch.stack(losses).mean())
            trajectory.states.append(state(model))
            trajectory.optimizer_state.append(optimizer_state_numel(opt, model))
            rank_losses.append(losses)
    return trajectory, rank_losses
