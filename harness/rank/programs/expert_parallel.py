"""Rank program for expert parallelism: build the router and the E experts from the dense weights
the driver sends (the same on every member), wrap them with the implementation's
ExpertParallelMoE over the group, run forward on this member's own tokens and backward with their
upstream gradient, and return what the driver judges.

The contract: ``ExpertParallelMoE.from_dense(router, experts, group=None)``, ``router`` an
``nn.Linear(h, E, bias=False)`` and ``experts`` E modules ``nn.Sequential(nn.Linear(h, f), nn.GELU(),
nn.Linear(f, h))``; the result is an nn.Module with ``.router`` (the replicated router) and
``.experts`` (this rank's E/n experts, the group-rank-th contiguous block, in order), whose forward
maps this rank's tokens [T, h] to [T, h] (top-1 routing, reference/expert_parallel.py). An expert
that no token reached may leave its gradients None: they are reported as zeros."""

from __future__ import annotations

import torch
from torch import nn

from parallelism_conformance.harness.rank import models
from parallelism_conformance.harness.rank.context import MissingFunction, RankContext, on_members, require
from parallelism_conformance.harness.rank.programs.tensor_parallel import _dense


def _build(ctx: RankContext, impl, process_group, router_weight, experts, **options):
    router = _dense(ctx, router_weight, None)
    modules = [nn.Sequential(_dense(ctx, w1, b1), nn.GELU(), _dense(ctx, w2, b2)) for w1, b1, w2, b2 in experts]
    return require(impl, "ExpertParallelMoE").from_dense(router, modules, group=process_group, **options)


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad


@on_members
def forward_backward(ctx: RankContext, impl, process_group, router_weight, experts, x, grad_output) -> dict:
    moe = _build(ctx, impl, process_group, router_weight, experts)
    missing = [name for name in ("router", "experts") if not hasattr(moe, name)]
    if missing:
        raise TypeError(
            f"ExpertParallelMoE.from_dense returned a {type(moe).__name__} without "
            f"{', '.join(missing)}: the contract needs .router and .experts"
        )
    x = ctx.to_device(x).requires_grad_(True)
    y = moe(x)
    y.backward(ctx.to_device(grad_output))
    local = [tuple(_grad(p) for p in (e[0].weight, e[0].bias, e[2].weight, e[2].bias)) for e in moe.experts]
    return ctx.to_cpu({"output": y, "grad_input": _grad(x), "grad_router": _grad(moe.router.weight), "grad_experts": local})


@on_members
def forward_backward_topk(
    ctx: RankContext,
    impl,
    process_group,
    router_weight,
    experts,
    x,
    grad_output,
    top_k: int,
    aux_weight: float,
    capacity_factor: float | None = None,
    sequence_parallel: bool = False,
) -> dict:
    """Capability moe_topk: ``from_dense(..., top_k=k, compute_aux_loss=True)`` (and, only when given,
    ``capacity_factor``: capability moe_capacity; ``sequence_parallel``: moe_sequence_parallel), forward, then backward of sum(y * grad_output) +
    aux_weight * moe.aux_loss (this member's share of the load-balancing loss); what
    forward_backward returns, and the aux_loss."""
    options = {} if capacity_factor is None else {"capacity_factor": capacity_factor}
    if sequence_parallel:  # capability moe_sequence_parallel: passed only then
        options["sequence_parallel"] = True
    moe = _build(ctx, impl, process_group, router_weight, experts, top_k=top_k, compute_aux_loss=True, **options)
    x = ctx.to_device(x).requires_grad_(True)
    y = moe(x)
    aux = getattr(moe, "aux_loss", None)
    if not torch.is_tensor(aux):
        raise TypeError(
            f"after forward, .aux_loss is {type(aux).__name__}: the contract needs a 0-dim tensor "
            "(this member's share of the load-balancing loss)"
        )
    ((y * ctx.to_device(grad_output)).sum() + aux_weight * aux).backward()
    local = [tuple(_grad(p) for p in (e[0].weight, e[0].bias, e[2].weight, e[2].bias)) for e in moe.experts]
    return ctx.to_cpu(
        {"output": y.detach(), "grad_input": _grad(x), "grad_router": _grad(moe.router.weight), "grad_experts": local, "aux_loss": aux.detach()}
    )


@on_members
def train_steps(
    ctx: RankContext,
    impl,
    process_group,
    router_weight,
    experts,
    x,
    grad_output,
    top_k: int,
    aux_weight: float,
    optimizer: dict,
    steps: int,
    sequence_parallel: bool = False,
) -> dict:
    """The layer of ``forward_backward_topk`` trained ``steps`` times on this member's loss
    sum(y * grad_output) + aux_weight * aux_loss, the optimizer ``optimizer`` (harness.rank.models)
    over the layer's parameters as this member holds them: each step's loss."""
    options = {"sequence_parallel": True} if sequence_parallel else {}
    moe = _build(ctx, impl, process_group, router_weight, experts, top_k=top_k, compute_aux_loss=True, **options)
    opt = models.build_optimizer(optimizer, [p for p in moe.parameters() if p.requires_grad])
    x, g = ctx.to_device(x), ctx.to_device(grad_output)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        y = moe(x)
        loss = (y * g).sum() + aux_weight * moe.aux_loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return ctx.to_cpu({"losses": torch.stack(losses)})


@on_members
def refusal(ctx: RankContext, impl, process_group, router_weight, experts) -> dict:
    """Build the layer from a number of experts the group does not divide: what was raised."""
    try:
        _build(ctx, impl, process_group, router_weight, experts)
    except (MissingFunction, NotImplementedError):
        raise
    except Exception as error:  # noqa: BLE001 - the driver judges what was raised
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None, "message": ""}


def mesh_step(ctx: RankContext, impl, router_weight, experts, x, grad_output, mesh: dict, group=None, sequence_parallel: bool = False) -> dict:
    """Expert parallelism inside data parallelism (capability ``moe_mesh``): a dp x ep mesh (``mesh``:
    {"ep": [...], "dp": [...]}, every rank makes every group in that order). The layer is built on
    this rank's expert-parallel group; forward on this rank's own tokens, backward of sum(y * G).
    Then the data-parallel reductions a trainer makes, with the implementation's ``all_reduce``: each
    local expert's gradients summed over its data-parallel group (the replicas of those experts), the
    router's over the whole world (it is replicated everywhere). What forward_backward returns, with
    the gradients so summed. ``sequence_parallel`` (capability moe_tp_mesh): the expert-parallel
    group is a tensor-parallel group whose members hold shards of one sequence; the layer is built
    with sequence_parallel=True, so it reduces the router's gradient over that group itself, and the
    trainer sums it over the data-parallel group only."""
    from torch.distributed import ReduceOp

    if group is not None:
        raise ValueError("a mesh spans the whole world")
    for axis in ("ep", "dp"):
        for members in mesh[axis]:
            ctx.group(members)
    ep, dp = (ctx.group(next(g for g in mesh[axis] if ctx.rank in g)) for axis in ("ep", "dp"))
    moe = _build(ctx, impl, ep, router_weight, experts, **({"sequence_parallel": True} if sequence_parallel else {}))
    x = ctx.to_device(x).requires_grad_(True)
    y = moe(x)
    y.backward(ctx.to_device(grad_output))
    all_reduce = require(impl, "all_reduce")

    def summed(tensor, over):
        tensor = tensor.detach().clone().contiguous()
        all_reduce(tensor, op=ReduceOp.SUM, group=over)
        return tensor

    local = [tuple(summed(_grad(p), dp) for p in (e[0].weight, e[0].bias, e[2].weight, e[2].bias)) for e in moe.experts]
    router = summed(_grad(moe.router.weight), dp if sequence_parallel else None)
    return ctx.to_cpu({"output": y.detach(), "grad_input": _grad(x), "grad_router": router, "grad_experts": local})


@on_members
def clip(ctx: RankContext, impl, process_group, router_weight, experts, x, grad_output, max_norm: float, norm_type: float) -> dict:
    """Capability moe_clipping: forward_backward's step, then the router's gradient summed over the
    group with the implementation's ``all_reduce`` (a trainer's reduction of a replicated parameter:
    the members' tokens are the batch), then the implementation's ``clip_grad_norm_(moe, max_norm,
    norm_type)``: what it returned and the clipped gradients."""
    from torch.distributed import ReduceOp

    moe = _build(ctx, impl, process_group, router_weight, experts)
    x = ctx.to_device(x).requires_grad_(True)
    moe(x).backward(ctx.to_device(grad_output))
    router = moe.router.weight
    if router.grad is None:
        router.grad = torch.zeros_like(router)
    require(impl, "all_reduce")(router.grad, op=ReduceOp.SUM, group=process_group)
    norm = require(impl, "clip_grad_norm_")(moe, max_norm, norm_type)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    local = [tuple(_grad(p) for p in (e[0].weight, e[0].bias, e[2].weight, e[2].bias)) for e in moe.experts]
    return ctx.to_cpu({"norm": norm.detach().clone() if torch.is_tensor(norm) else norm, "grad_router": _grad(router), "grad_experts": local})
