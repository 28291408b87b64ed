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

