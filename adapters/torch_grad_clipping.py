"""torch's own gradient clipping behind the suite's contract: ``torch.nn.utils.clip_grad_norm_`` over
the module's parameters, whatever their layout (plain tensors under DDP; DTensors under FSDP2 and
tensor parallelism, whose norm torch reduces over the mesh); a DTensor norm's full value is returned."""
from __future__ import annotations

import math

import torch
from torch import nn


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0):
    """torch.nn.utils.clip_grad_norm_ over the module's parameters (the module docstring).

    torch 2.13 cannot take the infinity norm when a rank's shard of a gradient is empty (a
    parameter with fewer rows than ranks: FSDP2 cuts dim 0 with torch.chunk): ``_foreach_norm``
    refuses the empty tensor on that rank while the others wait in the reduction. Every rank sees
    the global shapes, so every rank refuses that case alike, before any communication."""
    parameters = [p for p in module.parameters() if p.grad is not None]
    if math.isinf(norm_type):
        for p in parameters:
            mesh = getattr(p, "device_mesh", None)
            by_rows = mesh is not None and any(getattr(placement, "dim", None) == 0 for placement in p.placements)
            if by_rows and len(torch.empty(p.shape[0]).chunk(mesh.size())) < mesh.size():
                raise NotImplementedError(
                    f"torch's clip_grad_norm_ cannot take the infinity norm of row-sharded gradients when a rank's shard is "
                    f"empty (a parameter of {p.shape[0]} rows on {mesh.size()} ranks: _foreach_norm of an empty tensor)")
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
