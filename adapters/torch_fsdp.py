"""torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) behind the suite's fully sharded contract:
``fully_shard(module, group=None)`` builds a one-dimensional DeviceMesh over the group (on the
parameters' device type: CPU with gloo, CUDA with NCCL) and calls torch's ``fully_shard`` with its
defaults (``reshard_after_forward`` passed through; parameters sharded along dim 0 as DTensors, all-gathered before each unit's forward and
backward, gradients reduce-scattered; the root not resharded after forward).
``compute_dtype`` becomes ``MixedPrecisionPolicy(param_dtype=compute_dtype)``: parameters cast
before the all-gather, forward inputs cast, gradients reduce-scattered in it (torch's default
``reduce_dtype``) and kept in the parameters' dtype.
``gradient_divide_factor`` f: torch's ``set_gradient_divide_factor(f)`` on the module (the
reduce-scattered sum divided by f instead of the mesh's size). torch reduces with NCCL's
``PREMUL_SUM`` then, which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"), so off NCCL
``set_force_sum_reduction_for_comms(True)`` makes it a SUM followed by the division, torch's own
path for backends without it. On a world of one torch 2.13 divides the gradient it copies (there
is nothing to reduce) by f, and then again by its post-division factor whenever it takes the SUM
path: with that option or a reduce dtype other than float32 and bfloat16 (float64, float16). The
gradient ends divided by f^2 (measured: 1 became 0.25 with f = 2), so the option is not set on a
world of one, and a world of one in those dtypes with f != 1 is refused, naming torch's bug.
``full_parameters(module)`` gathers each DTensor parameter with ``full_tensor()``.

``init_sharded(module, seed, device)`` (capability ``fsdp_init``): FSDP2's own flow,
``module.to_empty(device=...)``, then each submodule's ``reset_parameters()`` drawn whole on the
CPU and each rank's shard kept (``distribute_tensor(..., src_data_rank=None)``: every rank drew the
same numbers, nothing is sent). Calling ``reset_parameters()`` on the DTensor parameters instead
draws through DTensor's random ops, which torch 2.13 supports only on CUDA-like devices
(``is_rng_supported_mesh``): on CPU ranks each rank then draws its local shard from its own
generator, the same numbers on every rank after the same seed (torchtitan#3106, FSDP2 with CPU
offload)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def fully_shard(
    module: nn.Module, group=None, reshard_after_forward: bool = True, compute_dtype=None, gradient_divide_factor=None
) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    device = next((p.device for p in module.parameters()), None)
    device_type = device.type if device is not None else "cpu"
    if device_type == "meta":  # built on the meta device (capability fsdp_init): the backend's devices
        device_type = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device_type)
    options = {} if reshard_after_forward else {"reshard_after_forward": False}  # True: torch's default (root kept)
    if compute_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype)
    torch_fully_shard(module, mesh=mesh, **options)
    if gradient_divide_factor is not None:
        reduce_dtypes = {compute_dtype} if compute_dtype is not None else {p.dtype for p in module.parameters() if p.is_floating_point()}
        if mesh.size() == 1 and gradient_divide_factor != 1 and reduce_dtypes - {torch.float32, torch.bfloat16}:
            raise NotImplementedError(
                f"torch's FSDP2 cannot apply gradient_divide_factor={gradient_divide_factor:g} on a world of one when it "
                f"reduces in {sorted(str(d).removeprefix('torch.') for d in reduce_dtypes)}: it divides by the factor "
                "twice (torch 2.13, foreach_reduce)"
            )
        module.set_gradient_divide_factor(float(gradient_divide_factor))
        if dist.get_backend(group) != "nccl" and mesh.size() > 1:
            module.set_force_sum_reduction_for_comms(True)
    return module


def full_parameters(module: nn.Module) -> dict:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for name, p in module.named_parameters()}


def init_sharded(module: nn.Module, seed: int, device=None) -> nn.Module:
    from torch.distributed.tensor import DTensor, distribute_tensor

    module.to_empty(device=torch.device("cpu") if device is None else device)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for owner in module.modules():
            reset = getattr(owner, "reset_parameters", None)
            if not callable(reset):
                continue
            held = dict(owner._parameters)
            whole = {name: torch.empty(p.shape, dtype=p.dtype) for name, p in held.items() if p is not None}
            try:
                for name, tensor in whole.items():
                    owner._parameters[name] = nn.Parameter(tensor, requires_grad=False)
                reset()
            finally:
                owner._parameters.update(held)
            for name, p in held.items():
                if isinstance(p, DTensor):
                    mine = distribute_tensor(whole[name], p.device_mesh, p.placements, src_data_rank=None)
                    p.to_local().copy_(mine.to_local())
                elif p is not None:
                    p.copy_(whole[name])
    return module
