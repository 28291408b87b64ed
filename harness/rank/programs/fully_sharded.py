"""Rank program for fully sharded data parallelism (CONTRACT.md, "Fully sharded data parallelism"):
build the model from its spec and seed (every rank the same), ``fully_shard`` each unit (every direct
child module with parameters that shares none with another child), then the root; train with an
optimizer over the sharded ``module.parameters()`` on this rank's slices of the global
micro-batches (one backward each, gradients accumulating, then one optimizer step); after every
step report the losses (one per micro-batch), the full parameters (the implementation's ``full_parameters``) and
buffers, and how many elements this rank holds: its trainable parameters, their gradients and the
optimizer state, local pieces only (a DTensor counts its local shard), and the dtypes of each kind
(with a compute dtype, every one must stay the model's)."""

from __future__ import annotations

import torch

from parallelism_conformance.harness.rank import library_loop, models
from parallelism_conformance.harness.rank.context import RankContext, require
from parallelism_conformance.harness.rank.token_loss import scale_of_step


def _local_numel(tensor) -> int:
    if hasattr(tensor, "ds_tensor"):  # a DeepSpeed ZeRO-3 parameter: its partition (the data is released)
        return tensor.ds_tensor.numel()
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel()


def units(net) -> list:
    """The units the harness shards first: direct children with parameters, except children that
    share a parameter with another child (tied weights stay with the root)."""
    owners: dict[int, set] = {}
    for child_name, child in net.named_children():
        for parameter in child.parameters():
            owners.setdefault(id(parameter), set()).add(child_name)
    shared = {name for names in owners.values() if len(names) > 1 for name in names}
    return [child for name, child in net.named_children() if name not in shared and any(True for _ in child.parameters())]


def sharded_model(
    ctx: RankContext,
    impl,
    model: dict,
    seed: int,
    reshard_after_forward: bool = True,
    compute_dtype: str | None = None,
    divide_factor: float | None = None,
):
    """The model of ``model`` (harness/rank/models.py) from ``seed``, every unit fully sharded, then
    the root; ``reshard_after_forward`` is passed only when False (ZeRO-2), ``compute_dtype`` (a
    torch dtype's name) and ``gradient_divide_factor`` only when set, so an implementation of ZeRO-3
    alone need not accept them."""
    fully_shard = require(impl, "fully_shard")
    options = {} if reshard_after_forward else {"reshard_after_forward": False}
    if compute_dtype is not None:
        options["compute_dtype"] = getattr(torch, compute_dtype)
    if divide_factor is not None:
        options["gradient_divide_factor"] = divide_factor
    net = models.build(model, seed).to(ctx.device)
    for unit in units(net):
        fully_shard(unit, **options)
    return fully_shard(net, **options)


def train(
    ctx: RankContext,
    impl,
    model: dict,
    seed: int,
    optimizer: dict,
    steps: int,
    batches: list[dict],
    reshard_after_forward: bool = True,
    compute_dtype: str | None = None,
    clip: dict | None = None,
    divide_factor: float | None = None,
    dropout_seeds: list[int] | None = None,
    group=None,
) -> dict:
    """``clip`` ({"max_norm", "norm_type"}): the implementation's ``clip_grad_norm_(module, max_norm,
    norm_type)`` after the step's backwards, before the optimizer's step; what it returns is reported.
    ``divide_factor`` f: a loss normalised by the global token count (harness/rank/token_loss.py):
    every unit sharded with ``gradient_divide_factor=f``, each micro-batch's summed loss scaled by
    f / global_token_count(...); the count is reported. ``dropout_seeds``: before its forward of
    step t the rank seeds torch's default generator with the t-th (its own dropout stream,
    reference/random_streams.py)."""
    if group is not None:
        raise ValueError("fully sharded data parallelism is tested on the whole world, not a subgroup")
    full_parameters = require(impl, "full_parameters")
    net = sharded_model(ctx, impl, model, seed, reshard_after_forward, compute_dtype, divide_factor)
    micro = [(ctx.to_device(b["inputs"]), ctx.to_device(b["targets"])) for b in batches]
    library_loop.accumulate(net, len(micro))
    opt = library_loop.take_optimizer(net, models.build_optimizer(optimizer, net.parameters()))
    clip_grad_norm_ = require(impl, "clip_grad_norm_") if clip is not None else None
    result = {"steps": []}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = []
        if dropout_seeds is not None:
            torch.manual_seed(dropout_seeds[step])
        scale, count = scale_of_step(impl, micro, divide_factor) if divide_factor is not None else (1.0, None)
        for inputs, targets in micro:  # gradient accumulation: .grad adds up over the backwards
            loss = net(inputs, targets)
            library_loop.backward(net, loss * scale if divide_factor is not None else loss)
            losses.append(loss.detach())
        norm = None
        if clip_grad_norm_ is not None:
            norm = clip_grad_norm_(net, clip["max_norm"], clip["norm_type"])
            norm = norm.detach().clone() if torch.is_tensor(norm) else norm
        opt.step()
        kinds = models.tensors_held(list(net.parameters()), opt)
        held = {kind: sum(_local_numel(t) for t in tensors) for kind, tensors in kinds.items()}
        dtypes = models.dtypes_held(kinds)
        # copies: an implementation may return its live replicated parameters (the handout says "as they are")
        state = {name: tensor.detach().clone() for name, tensor in full_parameters(net).items()}
        state.update({name: b.detach().clone() for name, b in net.named_buffers()})
        result["steps"].append(
            {
                "loss": torch.stack(losses),
                "state": state,
                "held": held,
                "dtypes": dtypes,
                "norm": norm,
                "count": count,
                "logits_dtype": getattr(net, "logits_dtype", None),
            }
        )
    return ctx.to_cpu(result)


def init_from_meta(ctx: RankContext, impl, model: dict, seed: int, stream_seed: int, optimizer: dict, batches: list[dict], group=None) -> dict:
    """Capability fsdp_init: the model built on the meta device (no storage, nothing drawn), every
    unit fully sharded, then the root; torch's default generator seeded with ``stream_seed`` (the
    rank's own stream); ``init_sharded(module, seed, device)``. Reports a draw of 4 numbers from the
    default generator right after (it must be the stream's first: init_sharded leaves it as it was),
    the full parameters, and one step of training on this rank's slices (losses, full parameters
    after the optimizer's step)."""
    if group is not None:
        raise ValueError("fully sharded data parallelism is tested on the whole world, not a subgroup")
    init_sharded, full_parameters = require(impl, "init_sharded"), require(impl, "full_parameters")
    fully_shard = require(impl, "fully_shard")
    with torch.device("meta"):
        net = models.build(model, 0)
    for unit in units(net):
        fully_shard(unit)
    net = fully_shard(net)
    torch.manual_seed(stream_seed)
    net = init_sharded(net, seed, ctx.device)
    stream = torch.rand(4, dtype=torch.float64)
    initial = {name: t.detach().clone() for name, t in full_parameters(net).items()}
    opt = models.build_optimizer(optimizer, net.parameters())
    opt.zero_grad(set_to_none=True)
    losses = []
    for b in batches:
        loss = net(ctx.to_device(b["inputs"]), ctx.to_device(b["targets"]))
        loss.backward()
        losses.append(loss.detach())
    opt.step()
    after = {name: t.detach().clone() for name, t in full_parameters(net).items()}
    return ctx.to_cpu({"stream": stream, "initial": initial, "loss": torch.stack(losses), "after": after})
