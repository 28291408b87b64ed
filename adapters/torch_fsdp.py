"""torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) behind the suite's fully sharded contract:
``fully_shard(module, group=None)`` builds a one-dimensional DeviceMesh over the group (on the
parameters' device type: CPU with gloo, CUDA with NCCL) and calls torch's ``fully_shard`` with its
defaults (``reshard_after_forward`` passed through; parameters sharded along dim 0 as DTensors, all-gathered before each unit's forward and
backward, gradients reduce-scattered; the root not resharded after forward).
``compute_dtype`` becomes ``MixedPrecisionPolicy(param_dtype=compute_dtype)``: parameters cast
before the all-gather, forward inputs cast, gradients reduce-scattered in it (torch's default
``reduce_dtype``) and kept in the parameters' dtype.
``full_parameters(module)`` gathers each DTensor parameter with ``full_tensor()``."""
from __future__ import annotations

import torch.distributed as dist
from torch import nn


def fully_shard(module: nn.Module, group=None, reshard_after_forward: bool = True, compute_dtype=None) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    device = next((p.device for p in module.parameters()), None)
    device_type = device.type if device is not None else "cpu"
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device_type)
    options = {} if reshard_after_forward else {"reshard_after_forward": False}  # True: torch's default (root kept)
    if compute_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype)
    torch_fully_shard(module, mesh=mesh, **options)
    return module


def full_parameters(module: nn.Module) -> dict:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in module.named_parameters()}


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0):
    """torch.nn.utils.clip_grad_norm_ over the module's parameters: with FSDP2's DTensor gradients
    the norm is a DTensor reduced over the mesh; its full value is returned.

    torch 2.13 cannot take the infinity norm when a rank's shard of a gradient is empty (a
    parameter with fewer rows than ranks: FSDP2 cuts dim 0 with torch.chunk): ``_foreach_norm``
    refuses the empty tensor on that rank while the others wait in the reduction. Every rank sees
    the global shapes, so every rank refuses that case alike, before any communication."""
    import math

    import torch

    parameters = [p for p in module.parameters() if p.grad is not None]
    if math.isinf(norm_type):
        for p in parameters:
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None and p.dim() and len(torch.empty(p.shape[0]).chunk(mesh.size())) < mesh.size():
                raise NotImplementedError(
                    f"torch's clip_grad_norm_ cannot take the infinity norm of FSDP2 gradients when a rank's shard is "
                    f"empty (a parameter of {p.shape[0]} rows on {mesh.size()} ranks: _foreach_norm of an empty tensor)")
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
