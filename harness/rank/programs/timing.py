"""Timing inside the ranks, the way nccl-tests and the OSU benchmarks do it: buffers allocated on
the rank (nothing large crosses the driver's socket), warm-up calls, a barrier, then ``iters``
back-to-back calls timed with perf_counter (after a device synchronize on GPU). Each rank returns
its own seconds per call; the driver takes the max over ranks."""

from __future__ import annotations

import time

import torch

from parallelism_conformance.harness.rank.context import RankContext, require


def _call(ctx: RankContext, impl, collective: str, numel: int, dtype: torch.dtype):
    """A zero-argument callable running one ``collective`` whose data size S is ``numel`` elements
    (S is the whole buffer: the gathered output of all-gather, the input of reduce-scatter)."""
    import torch.distributed as dist

    n = ctx.world_size
    fn = require(impl, collective)
    make = lambda k: torch.ones(k, dtype=dtype, device=ctx.device)
    if collective == "all_reduce":
        buffer = make(numel)
        return lambda: fn(buffer, op=dist.ReduceOp.SUM)
    if collective == "reduce_scatter_tensor":
        full, shard = make(numel), make(numel // n)
        return lambda: fn(shard, full, op=dist.ReduceOp.SUM)
    if collective == "all_gather_into_tensor":
        full, shard = make(numel), make(numel // n)
        return lambda: fn(full, shard)
    if collective == "all_to_all_single":
        source, target = make(numel), make(numel)
        return lambda: fn(target, source)
    if collective == "broadcast":
        buffer = make(numel)
        return lambda: fn(buffer, src=0)
    if collective == "reduce":
        buffer = make(numel)
        return lambda: fn(buffer, dst=0, op=dist.ReduceOp.SUM)
    raise ValueError(f"no timing recipe for {collective}")


def _synchronize(ctx: RankContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _seconds_per_call(ctx: RankContext, run, iters: int, warmup: int) -> dict:
    """Warm up, line the ranks up with a barrier, then time ``iters`` back-to-back calls."""
    import torch.distributed as dist

    for _ in range(warmup):
        run()
    _synchronize(ctx)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        run()
    _synchronize(ctx)
    return {"seconds": (time.perf_counter() - started) / iters}


def time_collective(ctx: RankContext, impl, collective: str, numel: int, dtype: str, iters: int, warmup: int, group=None) -> dict:
    run = _call(ctx, impl, collective, numel, getattr(torch, dtype))
    return _seconds_per_call(ctx, run, iters, warmup)


def time_tensor_parallel_mlp(ctx: RankContext, impl, hidden: int, ffn: int, tokens: int, iters: int, warmup: int = 2) -> dict:
    """Forward + backward of ``impl.TensorParallelMLP`` built from a dense MLP (hidden -> ffn ->
    hidden, the same seed on every rank) on ``tokens`` x ``hidden`` inputs, replicated."""
    from torch import nn

    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(hidden, ffn, device=ctx.device), nn.Linear(ffn, hidden, device=ctx.device)
    mlp = require(impl, "TensorParallelMLP").from_dense(fc1, fc2)
    x = torch.randn(tokens, hidden, device=ctx.device, requires_grad=True)
    grad = torch.randn(tokens, hidden, device=ctx.device)

    def step():
        mlp(x).backward(grad)

    return _seconds_per_call(ctx, step, iters, warmup)


def time_data_parallel_step(
    ctx: RankContext, impl, width: int, depth: int, global_batch: int, bucket_size_mb, iters: int, warmup: int = 2
) -> dict:
    """One SGD step of ``impl.DataParallel`` over an MLP of ``depth`` Linear(width, width) layers on
    this rank's slice of a fixed global batch (the same model seed on every rank)."""
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    model = require(impl, "DataParallel")(nn.Sequential(*layers).to(ctx.device), bucket_size_mb=bucket_size_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    local = global_batch // ctx.world_size
    x = torch.randn(local, width, device=ctx.device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        model.finish_gradient_synchronization()
        optimizer.step()

    return _seconds_per_call(ctx, step, iters, warmup)


def time_sharded_optimizer_step(
    ctx: RankContext, impl, width: int, depth: int, global_batch: int, sharded: bool, iters: int, warmup: int = 2
) -> dict:
    """One AdamW step over an MLP of ``depth`` Linear(width, width) layers on this rank's slice of a
    fixed global batch: with ``impl.ShardedOptimizer`` (ZeRO stage 1) when ``sharded``, else with
    ``impl.DataParallel`` (its default buckets) and a whole AdamW on every rank. Also returns the
    optimizer-state elements this rank holds after the steps."""
    from torch import nn

    from parallelism_conformance.harness.rank.programs.sharded_optimizer import local_state_numel

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    net = nn.Sequential(*layers).to(ctx.device)
    if sharded:
        optimizer = require(impl, "ShardedOptimizer")(net.parameters(), torch.optim.AdamW, lr=1e-3)
        model, finish, local_optimizer = net, (lambda: None), optimizer.optim
    else:
        model = require(impl, "DataParallel")(net, bucket_size_mb=None)
        optimizer = local_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        finish = model.finish_gradient_synchronization
    x = torch.randn(global_batch // ctx.world_size, width, device=ctx.device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        finish()
        optimizer.step()

    timing = _seconds_per_call(ctx, step, iters, warmup)
    return {**timing, "state_numel": local_state_numel(local_optimizer)}


def time_memory_strategies(
    ctx: RankContext, impl, width: int, depth: int, global_batch: int, strategy: str, iters: int, warmup: int = 2
) -> dict:
    """One AdamW step over an MLP of ``depth`` Linear(width, width) layers on this rank's slice of a
        fixed global batch, under ``strategy``: "dp" (impl.DataParallel, AdamW on every rank), "zero1"
        (impl.ShardedOptimizer), "fsdp" (impl.fully_shard on every layer, then the root) or "zero2" (the
    same with reshard_after_forward=False: gathered once per step). Returns the
        time and the elements this rank holds after the steps: trainable parameters, gradients and
        optimizer state (a DTensor counts its local shard)."""
    from torch import nn

    from parallelism_conformance.harness.rank.programs.fully_sharded import _local_numel

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    net = nn.Sequential(*layers).to(ctx.device)

    def finish() -> None:  # replaced by DP's gradient synchronisation
        pass

    if strategy == "dp":
        model = require(impl, "DataParallel")(net, bucket_size_mb=None)
        optimizer = local = torch.optim.AdamW(model.parameters(), lr=1e-3)
        finish = model.finish_gradient_synchronization
        parameters = list(net.parameters())
    elif strategy == "zero1":
        model = net
        optimizer = require(impl, "ShardedOptimizer")(net.parameters(), torch.optim.AdamW, lr=1e-3)
        local, parameters = optimizer.optim, list(net.parameters())
    elif strategy in ("fsdp", "zero2"):
        fully_shard = require(impl, "fully_shard")
        options = {"reshard_after_forward": False} if strategy == "zero2" else {}
        for layer in net:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, **options)
        model = fully_shard(net, **options)
        optimizer = local = torch.optim.AdamW(model.parameters(), lr=1e-3)
        parameters = list(model.parameters())
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    x = torch.randn(global_batch // ctx.world_size, width, device=ctx.device)

    def step():
        optimizer.zero_grad(set_to_none=False)  # keep the gradients: they count
        model(x).square().mean().backward()
        finish()
        optimizer.step()

    timing = _seconds_per_call(ctx, step, iters, warmup)
    held = (
        sum(_local_numel(p) for p in parameters)
        + sum(_local_numel(p.grad) for p in parameters if p.grad is not None)
        + sum(_local_numel(v) for state in local.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    )
    return {**timing, "held_numel": held}
