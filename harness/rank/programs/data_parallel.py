"""Rank program for data parallelism: build the model from its spec and this rank's seed, wrap it
with the implementation's DataParallel, and train on this rank's slice of the global batch (the
driver sends each rank its slice only). Returns what the driver judges: the state right after
wrapping, and per step the local loss, the gradients after synchronization, and the state after
the optimizer step."""

from __future__ import annotations

import torch

from parallelism_conformance.harness.rank import library_loop, models
from parallelism_conformance.harness.rank.context import RankContext, require
from parallelism_conformance.harness.rank.token_loss import scale_of_step

CONTRACT = ("module", "finish_gradient_synchronization")


def train(
    ctx: RankContext,
    impl,
    model: dict,
    seed: int,
    optimizer: dict,
    steps: int,
    batches: list,
    bucket_size_mb: float | None,
    set_to_none: bool = True,
    clip: dict | None = None,
    divide_factor: float | None = None,
    compute_dtype: str | None = None,
    group=None,
) -> dict:
    """Per step: wrapped.on_train_batch_start(optimizer) where the wrapper has it (the hook of CS336's
    handout); zero_grad(set_to_none); for each micro-batch of this rank (gradient accumulation
    when there are several): loss = wrapped(inputs, targets); loss.backward();
    wrapped.finish_gradient_synchronization(); with ``clip`` ({"max_norm", "norm_type"}) the
    implementation's clip_grad_norm_(wrapped.module, max_norm, norm_type), its result reported;
    then optimizer.step(). With ``divide_factor`` f (a loss normalised by the global token count,
    harness/rank/token_loss.py): DataParallel(..., gradient_divide_factor=f), and each micro-batch's
    summed loss is scaled by f / global_token_count(this rank's valid targets of the step); the
    count is reported. ``compute_dtype`` (a torch dtype's name): DataParallel(...,
    compute_dtype=d), passed only when set; the dtypes of the parameters, their gradients and the
    optimizer state, and of the model's logits, are reported."""
    if group is not None:
        raise ValueError("data parallelism is tested on the whole world, not a subgroup")
    DataParallel = require(impl, "DataParallel")
    net = models.build(model, seed).to(ctx.device)
    options = {} if divide_factor is None else {"gradient_divide_factor": divide_factor}
    if compute_dtype is not None:
        options["compute_dtype"] = getattr(torch, compute_dtype)
    wrapped = DataParallel(net, bucket_size_mb=bucket_size_mb, **options)
    missing = [name for name in CONTRACT if not hasattr(wrapped, name)]
    if missing:
        raise TypeError(
            f"DataParallel(module, bucket_size_mb) returned a {type(wrapped).__name__} without "
            f"{', '.join(missing)}: the contract needs .module and finish_gradient_synchronization()"
        )
    module = wrapped.module
    micro = [(ctx.to_device(b["inputs"]), ctx.to_device(b["targets"])) for b in batches]
    library_loop.accumulate(wrapped, len(micro))
    opt = library_loop.take_optimizer(wrapped, models.build_optimizer(optimizer, module.parameters()))
    result = {"wrapped": models.state(module), "steps": []}
    clip_grad_norm_ = require(impl, "clip_grad_norm_") if clip is not None else None
    start = getattr(wrapped, "on_train_batch_start", None)
    for _ in range(steps):
        if start is not None:
            start(opt)
        opt.zero_grad(set_to_none=set_to_none)
        losses = []
        scale, count = scale_of_step(impl, micro, divide_factor) if divide_factor is not None else (1.0, None)
        for inputs, targets in micro:
            loss = wrapped(inputs, targets)
            library_loop.backward(wrapped, loss * scale if divide_factor is not None else loss)
            wrapped.finish_gradient_synchronization()
            losses.append(loss.detach())
        stepped = library_loop.masters(wrapped, module)  # the model itself but where a library steps copies
        grads = {name: p.grad.detach().clone() for name, p in stepped.named_parameters() if p.grad is not None}
        norm = None
        if clip_grad_norm_ is not None:
            norm = clip_grad_norm_(module, clip["max_norm"], clip["norm_type"])
            norm = norm.detach().clone() if torch.is_tensor(norm) else norm
        opt.step()
        stepped = library_loop.masters(wrapped, module)  # read once after the step: a library's copies are built per call
        result["steps"].append(
            {
                "loss": torch.stack(losses),
                "grads": grads,
                "state": models.state(stepped),
                "norm": norm,
                "count": count,
                "dtypes": models.dtypes_held(models.tensors_held(list(stepped.parameters()), opt)),
                "logits_dtype": getattr(module, "logits_dtype", None),
            }
        )
    return ctx.to_cpu(result)
