"""torchtitan through the suite's contract, as its training loop uses it: ``--impl
parallelism_conformance.adapters.torchtitan`` in a venv that has torchtitan (``scripts/libraries
torchtitan``; docs/libraries.md has the verdicts and every shim).

* ``fully_shard(unit, group, reshard_after_forward, gradient_divide_factor=1)``: torch's
  ``fully_shard`` with the configuration torchtitan's ``apply_fsdp_to_decoder``
  (distributed/fsdp.py) gives every unit and the root: ``MixedPrecisionPolicy(param_dtype,
  reduce_dtype, cast_forward_inputs=False)`` with both dtypes the parameters' own (torchtitan's
  ``training.mixed_precision_param = "float32"`` on a float32 model; its dtype map has no float64, so
  a float64 model keeps float64), ``reshard_after_forward`` from torchtitan's
  ``get_fsdp_reshard_after_forward_policy`` ("always" or "never"), then torchtitan's
  ``disable_fsdp_gradient_division`` (gradient_divide_factor 1.0 on every FSDP module: gradients are
  summed over ranks). ``apply_fsdp_to_decoder`` itself needs torchtitan's Decoder (tok_embeddings,
  layers, norm, lm_head), so the harness's units are sharded one call each, as it shards a block.
  Without a divide factor (capability fully_sharded: gradients averaged) or with one other than 1,
  or with a compute dtype, the adapter refuses with torchtitan's reason (torchtitan_refusals.py).
* ``global_token_count``: torchtitan's ``dist_sum_tensor`` (distributed/utils.py; train_step's
  ``global_valid_tokens``) over a one-dimensional DeviceMesh of the group.
* ``pipeline_step``: adapters/torchtitan_pipeline.py (``_build_pipeline_schedule``).
* ``DataParallel``: refused, torchtitan has no DDP wrapper.
* ``full_parameters``: each DTensor parameter's ``full_tensor()``.

The one shim (listed in docs/libraries.md): off NCCL, ``set_force_sum_reduction_for_comms(True)``
on every FSDP module (torchtitan's own call in ``enable_fsdp_symm_mem``): FSDP2 reduce-scatters with
``ReduceOp.PREMUL_SUM(1 / factor)``, which gloo refuses, and with the option it reduce-scatters
with SUM and divides by the factor after, 1.0 here: the same values, the same bytes."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallelism_conformance.adapters import torchtitan_refusals as refusals
from parallelism_conformance.adapters.torchtitan_pipeline import pipeline_step  # noqa: F401 - re-exported: the contract's names

__all__ = ["fully_shard", "full_parameters", "global_token_count", "DataParallel", "pipeline_step"]


def _mesh(group, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group or dist.group.WORLD, device_type)


def _device_type(group) -> str:
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def fully_shard(
    module: nn.Module, group=None, reshard_after_forward: bool = True, compute_dtype=None, gradient_divide_factor=None
) -> nn.Module:
    refusals.require_layout()
    if gradient_divide_factor is None:  # refused before torchtitan is imported: a refusal costs no import
        raise NotImplementedError(refusals.AVERAGE)
    if gradient_divide_factor != 1:
        raise NotImplementedError(refusals.DIVIDE_FACTOR)
    if compute_dtype is not None:
        raise NotImplementedError(refusals.COMPUTE_DTYPE)
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division, get_fsdp_reshard_after_forward_policy

    mesh = _mesh(group, _device_type(group))
    # apply_fsdp_to_decoder's policy; None keeps the parameters' dtype (torchtitan's "float32" on float32)
    mp_policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, cast_forward_inputs=False)
    policy = "always" if reshard_after_forward else "never"
    torch_fully_shard(
        module,
        mesh=mesh,
        mp_policy=mp_policy,
        reshard_after_forward=get_fsdp_reshard_after_forward_policy(policy, pp_enabled=False),
    )
    disable_fsdp_gradient_division(module)
    if dist.get_backend(group) != "nccl" and mesh.size() > 1:
        # gloo has no PREMUL_SUM (the shim, see the docstring); torchtitan's enable_fsdp_symm_mem sets the same
        for owner in module.modules():
            if isinstance(owner, FSDPModule):
                owner.set_force_sum_reduction_for_comms(True)
    return module


def full_parameters(module: nn.Module) -> dict:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for name, p in module.named_parameters()}


def global_token_count(local_count, group=None) -> int:
    refusals.require_layout()
    from torchtitan.distributed.utils import dist_sum_tensor

    device = "cuda" if _device_type(group) == "cuda" else "cpu"
    count = torch.tensor(int(local_count), dtype=torch.int64, device=device)
    return int(dist_sum_tensor(count, _mesh(group, _device_type(group))).item())


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, *args, **kwargs):
        refusals.require_layout()
        raise NotImplementedError(refusals.DATA_PARALLEL)
