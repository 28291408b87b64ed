"""Rank programs of the communication audit (conformance/audit/): training steps whose
communication is labelled by phase (harness.rank.recording.mark), so the driver can hold each phase to
its own budget: building the wrapper (parameter broadcast, sharding) is "setup" and is not judged.
Outside an audited world mark() is a no-op. The collectives themselves are audited through
harness.rank.programs.collectives:call."""

from __future__ import annotations

import time

import torch
from torch import nn

from parallelism_conformance.harness.rank import library_loop, models, recording
from parallelism_conformance.harness.rank.context import RankContext, on_members, require

OVERLAP_WAIT_S = 2.0  # how long backward waits, at its last gradient, for a reduction to start


def data_parallel_step(
    ctx: RankContext,
    impl,
    model: dict,
    seed: int,
    frozen: list[str],
    batch: dict,
    bucket_size_mb: float | None,
    clip: dict | None = None,
    group=None,
) -> dict:
    """Build ``model`` (harness.rank.models spec) from ``seed``, freeze the parameters named in ``frozen``,
    wrap it with the implementation's DataParallel ("setup"), then one step: forward and backward
    ("backward"), finish_gradient_synchronization ("finish"). Returns the loss.

    With ``bucket_size_mb`` given, backward is held at its last gradient (the first trainable
    parameter's, registered before the implementation's own hooks, so it runs first) until a
    communication call has been recorded in this phase, or OVERLAP_WAIT_S: an implementation that
    overlaps reduces the buckets that are ready by then, one that defers everything to
    finish_gradient_synchronization, or to the last gradient's own hook, shows no call in
    "backward" (what follows the wait is "last_gradient"). Deterministic, not timed: a correct
    implementation is waited for, never raced. With ``clip`` ({"max_norm", "norm_type"}) the
    implementation's clip_grad_norm_ on the module follows ("clip")."""
    if group is not None:
        raise ValueError("data parallelism is audited on the whole world, not a subgroup")
    recording.mark("setup")
    net = models.build(model, seed).to(ctx.device)
    for name, parameter in net.named_parameters():
        if name in frozen:
            parameter.requires_grad_(False)
    if bucket_size_mb is not None:
        last = next(p for p in net.parameters() if p.requires_grad)
        last.register_hook(_wait_for_communication)
    wrapped = require(impl, "DataParallel")(net, bucket_size_mb=bucket_size_mb)
    inputs, targets = ctx.to_device(batch["inputs"]), ctx.to_device(batch["targets"])
    step_optimizer = torch.optim.SGD(wrapped.module.parameters(), lr=0.0)  # the optimizer the step would use
    library_loop.take_optimizer(wrapped, step_optimizer)  # a library's engine is built here, in "setup"
    start = getattr(wrapped, "on_train_batch_start", None)
    if start is not None:  # the optional hook at a step's start
        start(step_optimizer)
    recording.mark("backward")
    loss = wrapped(inputs, targets)
    library_loop.backward(wrapped, loss)
    recording.mark("finish")
    wrapped.finish_gradient_synchronization()
    if clip is not None:
        recording.mark("clip")
        require(impl, "clip_grad_norm_")(wrapped.module, clip["max_norm"], clip["norm_type"])
    recording.mark("after")
    return {"loss": loss.detach().cpu()}


def _wait_for_communication(grad):
    """At the last gradient, before the implementation's own hooks see it: wait for a reduction to
    have started, then label what follows "last_gradient", so that a reduction launched only now
    (every bucket at once, from the last gradient's hook: no overlap with the rest of backward) is
    told apart from one launched while backward still had gradients to compute."""
    deadline = time.monotonic() + OVERLAP_WAIT_S
    while not recording.count("backward") and time.monotonic() < deadline:
        time.sleep(0.001)
    recording.mark("last_gradient")
    return None


def sharded_optimizer_step(ctx: RankContext, impl, model: dict, seed: int, optimizer: dict, batch: dict, group=None) -> dict:
    """Build ``model`` from ``seed`` and the implementation's ShardedOptimizer over its parameters
    ("setup"), forward and backward ("backward"), then one optimizer step ("step"). Returns the loss."""
    if group is not None:
        raise ValueError("the sharded optimizer is audited on the whole world, not a subgroup")
    recording.mark("setup")
    net = models.build(model, seed).to(ctx.device)
    optimizer_class, options = models.optimizer_class(optimizer)
    opt = require(impl, "ShardedOptimizer")(net.parameters(), optimizer_class, **options)
    forward = library_loop.wrap_model(opt, net)
    inputs, targets = ctx.to_device(batch["inputs"]), ctx.to_device(batch["targets"])
    recording.mark("backward")
    loss = forward(inputs, targets)
    library_loop.backward(opt, loss)
    recording.mark("step")
    opt.step()
    recording.mark("after")
    return {"loss": loss.detach().cpu(), "library_loop": any(callable(getattr(opt, hook, None)) for hook in ("backward", "wrap_model"))}


@on_members
def expert_parallel(ctx: RankContext, impl, process_group, router_weight, experts, x, grad_output) -> dict:
    """ExpertParallelMoE.from_dense(router, experts) over the group ("setup"), forward on this
    member's tokens ("forward"), backward with their upstream gradient ("backward")."""
    from parallelism_conformance.harness.rank.programs.expert_parallel import _build

    recording.mark("setup")
    moe = _build(ctx, impl, process_group, router_weight, experts)
    x = ctx.to_device(x).requires_grad_(True)
    recording.mark("forward")
    y = moe(x)
    recording.mark("backward")
    y.backward(ctx.to_device(grad_output))
    recording.mark("after")
    return {"shape": list(y.shape)}


def _dense(ctx: RankContext, weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, dtype=weight.dtype, device=ctx.device)
    with torch.no_grad():
        linear.weight.copy_(ctx.to_device(weight))
        linear.bias.copy_(ctx.to_device(bias))
    return linear


@on_members
def tensor_parallel(ctx: RankContext, impl, process_group, layer: str, dense: dict, x: torch.Tensor, grad_output: torch.Tensor) -> dict:
    """``layer`` "mlp" (TensorParallelMLP.from_dense(fc1, fc2)), "mlp_sp" (the same with
    sequence_parallel=True) or "column" (ColumnParallelLinear.from_dense(fc1), gather_output=False):
    build ("setup"), forward on x ("forward": the full x, or this rank's sequence shard for mlp_sp),
    backward with ``grad_output`` (this rank's slice for the column layer, its sequence shard for
    mlp_sp) with x requiring a gradient ("backward"). Returns the output's shape."""
    recording.mark("setup")
    fc1 = _dense(ctx, dense["fc1_weight"], dense["fc1_bias"])
    if layer in ("mlp", "mlp_sp"):
        fc2 = _dense(ctx, dense["fc2_weight"], dense["fc2_bias"])
        module = require(impl, "TensorParallelMLP").from_dense(fc1, fc2, group=process_group, sequence_parallel=layer == "mlp_sp")
    else:
        module = require(impl, "ColumnParallelLinear").from_dense(fc1, group=process_group, gather_output=False)
    x = ctx.to_device(x).requires_grad_(True)
    recording.mark("forward")
    y = module(x)
    recording.mark("backward")
    local = y.to_local() if hasattr(y, "to_local") else y
    local.backward(ctx.to_device(grad_output))
    hook = getattr(module, "finish_gradient_synchronization", None)
    if callable(hook):  # part of backward where a module has it (CONTRACT.md's optional hooks)
        hook()
    recording.mark("after")
    return {"shape": list(local.shape)}


def fully_sharded_step(
    ctx: RankContext,
    impl,
    model: dict,
    seed: int,
    optimizer: dict,
    batch: dict,
    reshard_after_forward: bool = True,
    compute_dtype: str | None = None,
    clip: dict | None = None,
    group=None,
) -> dict:
    """Shard every unit, then the root ("setup", harness/rank/programs/fully_sharded.py's units), then one
    step: forward and backward ("step"), the optimizer's step ("optimizer"). Returns the loss and,
    as forward ends, the bytes of what the step's all-gathers and receives wrote that the
    implementation still holds (``held_after_forward``, recording.still_held: full weights kept
    for backward instead of gathered again). With ``clip`` the implementation's clip_grad_norm_
    runs between backward and the optimizer's step ("clip")."""
    from parallelism_conformance.harness.rank.programs.fully_sharded import sharded_model

    if group is not None:
        raise ValueError("fully sharded data parallelism is audited on the whole world, not a subgroup")
    recording.mark("setup")
    net = sharded_model(ctx, impl, model, seed, reshard_after_forward, compute_dtype)
    opt = library_loop.take_optimizer(net, models.build_optimizer(optimizer, net.parameters()))
    inputs, targets = ctx.to_device(batch["inputs"]), ctx.to_device(batch["targets"])
    recording.mark("step")
    recording.watch()
    loss = net(inputs, targets)
    held = sum(s["bytes"] for s in recording.still_held() if s["held"])
    library_loop.backward(net, loss)
    if clip is not None:
        recording.mark("clip")
        require(impl, "clip_grad_norm_")(net, clip["max_norm"], clip["norm_type"])
    recording.mark("optimizer")
    opt.step()
    recording.mark("after")
    return {"loss": loss.detach().cpu(), "held_after_forward": held}
