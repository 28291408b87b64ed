"""Rank program for the sharded optimizer (ZeRO stage 1): build the model from its spec (every rank
the same seed), wrap its parameters in the implementation's ShardedOptimizer, and train on this
rank's slice of the global batch. Returns what the driver judges: per step the local loss, the
state after the step, and how many optimizer-state elements this rank holds, and for how many
parameters."""

from __future__ import annotations

import torch

from parallelism_conformance.harness.rank import library_loop, models
from parallelism_conformance.harness.rank.context import RankContext, require

CONTRACT = ("step", "zero_grad", "optim")


def local_state_numel(optim) -> int:
    """Elements of the state tensors shaped like their parameter in the local optimizer (momentum,
    moments; not step counters): what this rank holds, whatever its parameters are (the model's
    own, or flat shards of them)."""
    return sum(v.numel() for p, st in optim.state.items() for v in st.values() if torch.is_tensor(v) and v.shape == p.shape)


def local_state_tensors(optim) -> int:
    """How many parameters (or flat shards) the local optimizer holds state shaped like them for."""
    return sum(1 for p, st in optim.state.items() if any(torch.is_tensor(v) and v.shape == p.shape for v in st.values()))


def train(
    ctx: RankContext,
    impl,
    model: dict,
    seed: int,
    optimizer: dict,
    steps: int,
    batch: dict | None = None,
    group=None,
    batches: list | None = None,
) -> dict:
    """Per step: opt.zero_grad(set_to_none=True); loss = net(inputs, targets); loss.backward();
    opt.step(). With ``batches`` (this rank's slices of k micro-batches) instead of ``batch``: a
    forward and backward per micro-batch before the step (gradient accumulation, the hook
    ``accumulate(k)`` told first), each step's losses reported stacked."""
    if group is not None:
        raise ValueError("the sharded optimizer is tested on the whole world, not a subgroup")
    ShardedOptimizer = require(impl, "ShardedOptimizer")
    net = models.build(model, seed).to(ctx.device)
    optimizer_class, options = models.optimizer_class(optimizer)
    opt = ShardedOptimizer(net.parameters(), optimizer_class, **options)
    micro = [(ctx.to_device(b["inputs"]), ctx.to_device(b["targets"])) for b in (batches if batches is not None else [batch])]
    if batches is not None:
        library_loop.accumulate(opt, len(micro))
    forward = library_loop.wrap_model(opt, net)  # a library's engine: .optim exists from here on
    missing = [name for name in CONTRACT if not hasattr(opt, name)]
    if missing:
        raise TypeError(
            f"ShardedOptimizer(params, optimizer_class, **defaults) returned a {type(opt).__name__} "
            f"without {', '.join(missing)}: the contract needs step(), zero_grad() and .optim"
        )
    result = {"steps": []}
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = []
        for inputs, targets in micro:
            loss = forward(inputs, targets)
            library_loop.backward(opt, loss)
            losses.append(loss.detach())
        opt.step()
        result["steps"].append(
            {
                "loss": torch.stack(losses) if batches is not None else losses[0],
                "state": models.state(net),
                "optimizer_state_numel": local_state_numel(opt.optim),
                "optimizer_state_tensors": local_state_tensors(opt.optim),
            }
        )
    return ctx.to_cpu(result)
