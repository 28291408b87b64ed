"""Gradient clipping by the global norm, across the layouts of the bundled implementations
(CONTRACT.md, "Gradient clipping"): ``clip_grad_norm_(module, max_norm, norm_type=2.0)``.

The norm is the one of every gradient as one vector, N = (sum_p sum_e |g_pe|^q)^(1/q) (max for
q = inf), as one process would compute it on the full gradients (torch.nn.utils.clip_grad_norm_),
and every gradient is scaled by min(1, max_norm / (N + 1e-6)). Each rank holds pieces, so each
part of the sum is counted where it lives, once:

* a parameter sharded by ``fully_shard`` (impls.fully_sharded): rank i holds piece i of the
  (zero-padded) gradient, so the pieces' sum of |g|^q is all-reduced (SUM; MAX for q = inf) over
  the unit's group: every element is counted on exactly one rank;
* a tensor-parallel layer (impls.tensor_parallel) holds its shard of the weight, and the column
  layer its shard of the bias, so those are reduced over the layer's group; the row layer's bias
  is whole on every member: replicated;
* an expert-parallel layer (impls.expert_parallel) holds its block of the experts: their sums are
  reduced over the layer's group; its router is replicated;
* any other parameter with a gradient is replicated (data parallelism keeps whole, averaged
  gradients everywhere): counted locally, once, never reduced (reducing it would count it n times);
* a parameter held by two modules (tied weights) is one parameter, counted once;
* pipeline stages (``module`` a list of this rank's stages, ``pp_group`` the pipeline's group):
  each rank holds its own stages' parameters, so after the above the ranks' sums are added over
  the pipeline (MAX for q = inf), torchtitan's fix for clipping by one stage's norm
  (torchtitan#596); a weight tied across stages (``tied``) is counted by its first listed use only.

The partial sums are taken in float64, so the returned norm (float64, 0-d, identical on every rank:
every rank combines the same reduced numbers) does not depend on how the pieces are cut.

Never imports reference/.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from . import collectives
from .expert_parallel import ExpertParallelMoE
from .fully_sharded import _STATE
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear


def _partial(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """sum |g|^q of ``grads`` (max |g| for q = inf), float64."""
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        g = g.detach().double()
        total = torch.maximum(total, g.abs().max()) if math.isinf(norm_type) else total + g.abs().pow(norm_type).sum()
    return total


def _sharded_parameters(module: nn.Module):
    """(group, its parameters sharded over that group) for every layer of ``module`` that holds
    shards: fully sharded units and tensor-parallel layers."""
    for m in module.modules():
        unit = getattr(m, _STATE, None)
        if unit is not None:
            yield unit.group, unit.pieces()
        elif isinstance(m, ColumnParallelLinear):
            yield m.group, [p for p in (m.weight, m.bias) if p is not None]
        elif isinstance(m, RowParallelLinear):
            yield m.group, [m.weight]
        elif isinstance(m, ExpertParallelMoE):  # each member holds its block of the experts
            yield m.group, list(m.experts.parameters())


def _tied_copies(stages: list[nn.Module], tied, pp_group) -> set[int]:
    """ids of this rank's copies of a weight tied across stages that are not its first listed use:
    the first use counts the weight, the other copies (holding the same, synchronised gradient)
    do not (Megatron-LM#7227: counted twice, the norm sqrt(2) times too large)."""
    p, me = dist.get_world_size(pp_group), dist.get_rank(pp_group)

    def parameter(stage: int, name: str):
        return stages[stage // p].get_parameter(name) if stage % p == me else None

    first = parameter(*tied[0])
    return {id(q) for q in (parameter(*use) for use in tied[1:]) if q is not None and q is not first}


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0, pp_group=None, tied=None) -> torch.Tensor:
    """Scale every gradient of ``module`` (or of every module of a list: a rank's pipeline stages)
    by min(1, max_norm / (N + 1e-6)), N the global norm of all of them, over ``pp_group``'s stages
    too when given (module docstring); returns N. ``tied``: the (stage, name) uses of a weight tied
    across the pipeline's stages, as sync_tied_gradients takes them: counted once."""
    stages = list(module) if isinstance(module, (list, tuple)) else [module]
    excluded = _tied_copies(stages, tied, pp_group) if tied else set()
    if isinstance(module, (list, tuple)):
        module = nn.ModuleList(module)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    sharded: dict[int, tuple[object, list[torch.Tensor]]] = {}  # id(group) -> (group, gradients)
    in_units: set[int] = set()
    for group, pieces in _sharded_parameters(module):
        for piece in pieces:
            if id(piece) not in in_units and piece.grad is not None:
                sharded.setdefault(id(group), (group, []))[1].append(piece.grad)
            in_units.add(id(piece))
    replicated = [p.grad for p in module.parameters() if id(p) not in in_units and id(p) not in excluded and p.grad is not None]
    combine = torch.maximum if math.isinf(norm_type) else torch.add
    total = _partial(replicated, norm_type)
    for group, grads in sharded.values():
        part = _partial(grads, norm_type).reshape(1)
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        collectives.all_reduce(part, op=op, group=group)
        total = combine(total, part[0])
    if pp_group is not None:  # every stage's sum, added over the pipeline
        whole = total.reshape(1).clone()
        collectives.all_reduce(whole, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=pp_group)
        total = whole[0]
    norm = total if math.isinf(norm_type) else total.pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p.grad.mul_(coefficient.to(p.grad.dtype))
    return norm
