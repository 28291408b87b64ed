"""torch's own gradient clipping behind the suite's contract: ``torch.nn.utils.clip_grad_norm_`` over
the module's parameters, whatever their layout (plain tensors under DDP; DTensors under FSDP2 and
tensor parallelism, whose norm torch reduces over the mesh); a DTensor norm's full value is returned."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0, pp_group=None, tied=None):
    """torch.nn.utils.clip_grad_norm_ over the module's parameters (the module docstring).

    torch 2.13 cannot take the infinity norm when a rank's shard of a gradient is empty (a
    parameter with fewer rows than ranks: FSDP2 cuts dim 0 with torch.chunk): ``_foreach_norm``
    refuses the empty tensor on that rank while the others wait in the reduction. Every rank sees
    the global shapes, so every rank refuses that case alike, before any communication."""
    stages = list(module) if isinstance(module, (list, tuple)) else [module]
    if isinstance(module, (list, tuple)):  # a rank's pipeline stages
        module = nn.ModuleList(module)
    parameters = [p for p in module.parameters() if p.grad is not None]
    experts = [m for m in module.modules() if hasattr(m, "experts") and hasattr(m, "group") and hasattr(m, "router")]
    if experts:
        return _clip_with_experts(parameters, experts, max_norm, float(norm_type))
    if pp_group is not None:
        counted = parameters
        if tied:  # a weight tied across stages: its first listed use counts it, the other copies not
            p_size, me = dist.get_world_size(pp_group), dist.get_rank(pp_group)
            uses = [stages[s // p_size].get_parameter(n) if s % p_size == me else None for s, n in tied]
            others = {id(q) for q in uses[1:] if q is not None and q is not uses[0]}
            counted = [p for p in parameters if id(p) not in others]
        return _clip_over_the_pipeline(parameters, max_norm, float(norm_type), pp_group, counted)
    if math.isinf(norm_type):
        for p in parameters:
            mesh = getattr(p, "device_mesh", None)
            by_rows = mesh is not None and any(getattr(placement, "dim", None) == 0 for placement in p.placements)
            if by_rows and len(torch.empty(p.shape[0]).chunk(mesh.size())) < mesh.size():
                raise NotImplementedError(
                    f"torch's clip_grad_norm_ cannot take the infinity norm of row-sharded gradients when a rank's shard is "
                    f"empty (a parameter of {p.shape[0]} rows on {mesh.size()} ranks: _foreach_norm of an empty tensor)"
                )
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _clip_over_the_pipeline(parameters: list, max_norm: float, norm_type: float, pp_group, counted: list):
    """torchtitan's clipping over pipeline stages from torch's pieces: this rank's stages' norm
    (``get_total_norm`` of the ``counted`` parameters), its q-th power summed over the pipeline (MAX
    for inf), then ``clip_grads_with_norm_`` of every parameter by that norm."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in counted], norm_type)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norm = norm.double().reshape(1)
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pp_group)
    else:
        norm = norm.pow(norm_type)
        dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_group)
        norm = norm.pow(1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm[0])
    return norm[0]


def _clip_with_experts(parameters: list, layers: list, max_norm: float, norm_type: float):
    """torch has no expert-parallel layer; torchtitan keeps experts as DTensors on the expert mesh,
    whose norm torch reduces over it. The same from torch's pieces: each layer's local experts'
    norm (``get_total_norm``), its q-th power summed over the layer's group (MAX for inf), the other
    parameters (the router, replicated) counted here once, then ``clip_grads_with_norm_``."""
    in_experts = {id(p) for layer in layers for p in layer.experts.parameters()}
    local = [p.grad for p in parameters if id(p) not in in_experts]
    parts = [torch.nn.utils.get_total_norm(local, norm_type).double().reshape(1)] if local else []
    for layer in layers:
        grads = [p.grad for p in layer.experts.parameters() if p.grad is not None]
        part = (torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros(())).double().reshape(1)
        if not math.isinf(norm_type):
            part = part.pow(norm_type)
        dist.all_reduce(part, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=layer.group)
        parts.append(part if math.isinf(norm_type) else part.pow(1.0 / norm_type))
    stacked = torch.cat(parts) if parts else torch.zeros(1, dtype=torch.float64)
    norm = stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum().pow(1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
