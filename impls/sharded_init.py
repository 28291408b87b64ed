"""Initialising a fully sharded model built on the meta device (CONTRACT.md, "Fully sharded data
parallelism", capability ``fsdp_init``): ``init_sharded(module, seed, device)``.

The parameters must be the ones one process draws: torch.manual_seed(seed), then each submodule's
reset_parameters() in modules() order. A rank cannot draw only its piece of a parameter from
torch's CPU generator (a Mersenne Twister: no skipping ahead to an offset), so for each submodule
in turn it draws that submodule's parameters whole, in their dtype, on the CPU, and keeps its piece
(the same flattened, zero-padded piece fully_shard cut): at most one submodule's full parameters
exist at a time. Every rank draws the same numbers, so no communication is needed. Drawing only
the piece's own shape from the seed would give every rank the same numbers (torchtitan#3106).
The caller's generator is forked and restored: its dropout streams go on undisturbed.

Never imports reference/.
"""

from __future__ import annotations

import torch
from torch import nn

from .fully_sharded import _STATE


def _layouts(module: nn.Module) -> dict[int, tuple]:
    """id(piece) -> (full shape, its unit) for every piece a unit of ``module`` holds."""
    found = {}
    for m in module.modules():
        unit = getattr(m, _STATE, None)
        if unit is not None:
            for piece, (_, shape, _numel) in zip(unit.pieces(), unit.sharded):
                found[id(piece)] = (shape, unit)
    return found


def init_sharded(module: nn.Module, seed: int, device=None) -> nn.Module:
    """Materialise ``module`` (built on the meta device, then fully sharded) on ``device`` with the
    parameters of one process's default initialisation from ``seed``; returns it."""
    device = torch.device("cpu") if device is None else torch.device(device)
    _materialise(module, device)
    layouts = _layouts(module)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for owner in module.modules():
            reset = getattr(owner, "reset_parameters", None)
            if not callable(reset):
                continue
            held = dict(owner._parameters)
            whole = {
                name: torch.empty(layouts[id(p)][0] if id(p) in layouts else p.shape, dtype=p.dtype)
                for name, p in held.items()
                if p is not None
            }
            try:
                for name, tensor in whole.items():
                    owner._parameters[name] = nn.Parameter(tensor, requires_grad=False)
                reset()
            finally:
                owner._parameters.update(held)
            for name, p in held.items():
                if p is None:
                    continue
                if id(p) in layouts:
                    p.copy_(layouts[id(p)][1]._piece(whole[name]))
                else:
                    p.copy_(whole[name])
    return module


def _materialise(module: nn.Module, device: torch.device) -> None:
    """Every meta parameter and buffer replaced by uninitialised storage on ``device``, one new
    tensor per old one, so a parameter two modules share stays shared (nn.Module.to_empty makes a
    new Parameter per holder)."""
    made: dict[int, torch.Tensor] = {}
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    empty = torch.empty_like(t, device=device)
                    made[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
                table[name] = made[id(t)]
