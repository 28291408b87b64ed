"""Rank programs for pipeline parallelism. Every rank builds the same sequential model from its spec
and seed (harness/rank/pipeline_models.py), splits it into S = p * v stages by the layer counts the
driver sent, keeps its own stages (in stage order: s % p == rank, or in the V placement stages rank
and 2p - 1 - rank) and calls the implementation's ``pipeline_step``. Rank 0 is sent the batch's
inputs, the rank holding the last stage its targets, the others None.
What comes back: the loss (None where the implementation returned None) and the .grad of every
local parameter keyed by its stable name ``stage<s>.<name>``; the driver judges it against
reference/pipeline_parallel.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallelism_conformance.harness.rank import models, pipeline_models, recording
from parallelism_conformance.harness.rank.context import MissingFunction, RankContext, require
from parallelism_conformance.harness.rank.programs.pipeline_stages import (
    local_stages,
    over_the_batchs_valid_rows,
    placement_argument,
    schedule_argument,
    stage_grads,
    watch,
)

CALL = "CALL"  # in the recorded order: a pipeline_step call begins


def train_step(
    ctx: RankContext,
    impl,
    model: dict,
    seed: int,
    layers_per_stage: list[int],
    stages_per_rank: int,
    num_microbatches: int,
    loss: str,
    inputs=None,
    targets=None,
    schedule: str | None = "1f1b",
    schedule_rows: list | None = None,
    placement: str = "loop",
    calls: int = 1,
    clip: dict | None = None,
    per_token: bool = False,
    tied: list | None = None,
    rng_seed: int | None = None,
    group=None,
) -> dict:
    """``impl.pipeline_step`` on the whole world, ``calls`` times on the same batch (gradient
    accumulation across steps: .grad is never reset between them; the loss of the last call is
    reported). ``schedule_rows`` (one list of compact actions per rank) is handed over as a
    callable schedule instead of a kind; ``placement`` "v" builds this rank's stages of the V and
    says so to pipeline_step. ``per_token``: the loss is ``loss`` (a sum over the valid rows) divided
    by the valid rows of the whole batch, C (the last stage holds every target, so it counts them),
    and pipeline_step is called with ``scale_grads=False``: the step's loss is the sum over
    microbatches, (1/C) of every valid row's error. ``clip`` ({"max_norm", "norm_type"}): then the implementation's
    ``clip_grad_norm_(this rank's stages, max_norm, norm_type, pp_group=the world)``, its result
    reported as "norm" and the gradients reported clipped. ``tied`` ([stage, parameter name] of
    every copy of a weight tied across stages, capability pipeline_tied): after the calls, the
    implementation's ``sync_tied_gradients(this rank's stages, tied)``. ``rng_seed``: torch's default
    generator seeded with it before the calls (this rank's dropout stream, capability pipeline_dropout)."""
    if group is not None:
        raise ValueError("pipeline parallelism is tested on the whole world, not a subgroup")
    pipeline_step = require(impl, "pipeline_step")
    indices, modules = local_stages(ctx, model, seed, layers_per_stage, stages_per_rank, placement)
    executed = watch(indices, modules)
    loss_fn, options = pipeline_models.loss_fn(loss), placement_argument(placement)
    if per_token:
        loss_fn, options = over_the_batchs_valid_rows(loss_fn, targets), {**options, "scale_grads": False}
    if rng_seed is not None:
        torch.manual_seed(rng_seed)
    for _ in range(calls):
        executed.append(CALL)  # each call's order is judged on its own (a runtime may warm up per call)
        result = pipeline_step(
            modules if stages_per_rank > 1 else modules[0],
            ctx.to_device(inputs),
            ctx.to_device(targets),
            loss_fn,
            num_microbatches,
            schedule=schedule_argument(schedule, schedule_rows),
            **options,
        )
    if tied is not None:
        require(impl, "sync_tied_gradients")(modules if stages_per_rank > 1 else modules[0], [(int(stage), str(name)) for stage, name in tied])
    norm = None
    if clip is not None:
        counted_once = {} if tied is None else {"tied": [(int(stage), str(name)) for stage, name in tied]}
        norm = require(impl, "clip_grad_norm_")(
            modules if stages_per_rank > 1 else modules[0], clip["max_norm"], clip["norm_type"], pp_group=dist.group.WORLD, **counted_once
        )
        norm = norm.detach().clone() if torch.is_tensor(norm) else norm
    return ctx.to_cpu({"loss": result, "grads": stage_grads(indices, modules), "executed": executed, "norm": norm})


def train_steps(
    ctx: RankContext,
    impl,
    model: dict,
    seed: int,
    layers_per_stage: list[int],
    stages_per_rank: int,
    num_microbatches: int,
    loss: str,
    optimizer: dict,
    steps: int,
    inputs=None,
    targets=None,
    schedule: str = "1f1b",
    calls: int = 1,
    clip: dict | None = None,
    tied: list | None = None,
    per_token: bool = False,
    group=None,
) -> dict:
    """``steps`` optimizer steps of this rank's stages (the optimizer of ``optimizer`` over them):
    each zero_grad(set_to_none=True), ``calls`` pipeline_step calls on the batch, the
    implementation's clip_grad_norm_ over the pipeline with ``clip`` (with ``tied``, after
    sync_tied_gradients, and told of the tied weight), then the optimizer's step.
    ``per_token``: the loss over the batch's valid rows and ``scale_grads=False``, as in train_step.
    Reports each step's loss (None off the last stage) and the first step as ``train_step``
    reports its one step (loss, gradients before the optimizer, what ran, the norm)."""
    if group is not None:
        raise ValueError("pipeline parallelism is tested on the whole world, not a subgroup")
    pipeline_step = require(impl, "pipeline_step")
    indices, modules = local_stages(ctx, model, seed, layers_per_stage, stages_per_rank)
    executed = watch(indices, modules)
    stages = modules if stages_per_rank > 1 else modules[0]
    opt = models.build_optimizer(optimizer, list({id(p): p for m in modules for p in m.parameters()}.values()))
    tied = None if tied is None else [(int(stage), str(name)) for stage, name in tied]
    loss_fn, options = pipeline_models.loss_fn(loss), {}
    if per_token:
        loss_fn, options = over_the_batchs_valid_rows(loss_fn, targets), {"scale_grads": False}
    losses, first = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(calls):
            result = pipeline_step(
                stages, ctx.to_device(inputs), ctx.to_device(targets), loss_fn, num_microbatches, schedule=schedule, **options
            )
        if tied is not None:
            require(impl, "sync_tied_gradients")(stages, tied)
        norm = None
        if clip is not None:
            norm = require(impl, "clip_grad_norm_")(
                stages, clip["max_norm"], clip["norm_type"], pp_group=dist.group.WORLD, **({} if tied is None else {"tied": tied})
            )
            norm = norm.detach().clone() if torch.is_tensor(norm) else norm
        if step == 0:
            first = {"loss": result, "grads": stage_grads(indices, modules), "executed": list(executed), "norm": norm}
        opt.step()
        losses.append(None if result is None else result.detach().clone())
    return ctx.to_cpu({"losses": losses, "first": first})


def split(ctx: RankContext, impl, model: dict, seed: int, num_stages: int, inputs, group=None) -> dict:
    """The implementation's ``split_stages(model, num_stages)`` of the model of ``model``: which of
    the model's own layers (by index) each stage holds, in the order the stage's modules list them,
    the layers that are no layer of the model (copies), and the stages run one after another on
    ``inputs`` (no gradient). What it raised instead, if anything."""
    net = pipeline_models.build(model, seed).to(ctx.device)
    layers = list(net.children())
    where = {id(layer): i for i, layer in enumerate(layers)}
    try:
        stages = require(impl, "split_stages")(net, num_stages)
    except (MissingFunction, NotImplementedError):  # not implemented: the harness reports it
        raise
    except Exception as error:  # noqa: BLE001 - the driver judges what was raised
        return {"raised": type(error).__name__, "message": str(error)}
    held = [[where[id(m)] for m in stage.modules() if id(m) in where] for stage in stages]
    foreign = sum(1 for stage in stages for m in stage.modules() if isinstance(m, pipeline_models.Layer) and id(m) not in where)
    with torch.no_grad():
        x = ctx.to_device(inputs)
        chained = x
        for stage in stages:
            chained = stage(chained)
    return ctx.to_cpu({"raised": None, "stages": held, "copies": foreign, "chained": chained})


def timed_steps(
    ctx: RankContext,
    impl,
    model: dict,
    seed: int,
    layers_per_stage: list[int],
    stages_per_rank: int,
    num_microbatches: int,
    loss: str,
    repeats: int,
    inputs=None,
    targets=None,
    schedule: str | None = "1f1b",
    schedule_rows: list | None = None,
    placement: str = "loop",
    group=None,
) -> dict:
    """``repeats`` steps, each after a barrier, with ``trace``: per step, this rank's
    [action, start, end] in time.perf_counter seconds (one clock for every process on a host).
    ``schedule_rows`` (one list of compact actions per rank) is handed over as a callable schedule."""
    pipeline_step = require(impl, "pipeline_step")
    _, modules = local_stages(ctx, model, seed, layers_per_stage, stages_per_rank, placement)
    traces = []
    for _ in range(repeats):
        for module in modules:
            module.zero_grad(set_to_none=True)
        trace: list = []
        dist.barrier()
        pipeline_step(
            modules if stages_per_rank > 1 else modules[0],
            ctx.to_device(inputs),
            ctx.to_device(targets),
            pipeline_models.loss_fn(loss),
            num_microbatches,
            schedule=schedule_argument(schedule, schedule_rows),
            trace=trace,
            **placement_argument(placement),
        )
        traces.append([[str(a), float(start), float(end)] for a, start, end in trace])
    return {"traces": traces}


def generate_schedule(ctx: RankContext, impl, kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int, group=None) -> dict:
    """{"rows": impl.generate_schedule(...) as lists of strings}, or {"refused": "<error>"} when it
    raises a ValueError (arguments it declines, e.g. interleaved with m not a multiple of p)."""
    generate = require(impl, "generate_schedule")
    try:
        rows = generate(kind, num_ranks, num_microbatches, stages_per_rank)
    except ValueError as error:
        return {"refused": f"{type(error).__name__}: {error}"}
    return {"rows": [[a if isinstance(a, str) else str(a) for a in row] for row in rows]}


def dp_pp_step(
    ctx: RankContext,
    impl,
    model: dict,
    seed: int,
    layers_per_stage: list[int],
    num_microbatches: int,
    loss: str,
    pipeline_groups: list[list[int]],
    data_parallel_groups: list[list[int]],
    inputs=None,
    targets=None,
    schedule: str = "1f1b",
    per_token: bool = False,
    group=None,
) -> dict:
    """Data parallelism over pipelines on a pp x dp mesh (reference/mesh.py, ``pipeline_mesh``):
    the implementation's ``pipeline_step`` on this rank's pipeline group (its replica's batch goes
    to the group's first rank, the targets to its last), then every stage gradient summed over
    this rank's data-parallel group with the implementation's ``all_reduce`` and divided by its
    size. Returns the loss (None off the last stage), the averaged gradients and the order run.

    ``per_token`` (capability dp_pp_token_loss): the loss is ``loss`` (a sum over the valid rows)
    over C, the valid rows of the whole global batch, which the last stages obtain with the
    implementation's ``global_token_count(their valid rows, group=their data-parallel group)``;
    pipeline_step runs with ``scale_grads=False`` and the gradients are summed over the
    data-parallel group, not averaged (the loss is already the global mean). Also returned: the
    count the last stage got."""
    from torch.distributed import ReduceOp

    if group is not None:
        raise ValueError("a mesh spans the whole world")
    for members in [*pipeline_groups, *data_parallel_groups]:
        ctx.group(members)
    mine = next(g for g in pipeline_groups if ctx.rank in g)
    pp, dp = ctx.group(mine), ctx.group(next(g for g in data_parallel_groups if ctx.rank in g))
    replicas = len(data_parallel_groups[0])
    stage = sorted(mine).index(ctx.rank)
    stages = pipeline_models.split(pipeline_models.build(model, seed).to(ctx.device), layers_per_stage)
    module = stages[stage]
    executed = watch([stage], [module])
    pipeline_step, all_reduce = require(impl, "pipeline_step"), require(impl, "all_reduce")
    loss_fn, options, count = pipeline_models.loss_fn(loss), {}, None
    if per_token:
        if targets is not None:  # the last stage: it holds the targets, so it counts
            count = require(impl, "global_token_count")(pipeline_models.valid_rows(targets), group=dp)
            count = int(count.item()) if torch.is_tensor(count) else int(count)
        summed, divisor = loss_fn, count or 1

        def loss_fn(output, target):
            return summed(output, target) / divisor

        options = {"scale_grads": False}
    result = pipeline_step(
        module, ctx.to_device(inputs), ctx.to_device(targets), loss_fn, num_microbatches, schedule=schedule, group=pp, **options
    )
    grads = {}
    for name, parameter in module.named_parameters():
        if parameter.grad is None:
            continue
        summed = parameter.grad.detach().clone().contiguous()
        all_reduce(summed, op=ReduceOp.SUM, group=dp)
        grads[f"stage{stage}.{name}"] = summed if per_token else summed / replicas
    return ctx.to_cpu({"loss": result, "grads": grads, "executed": executed, "stage": stage, "count": count})


def mesh_step(
    ctx: RankContext,
    impl,
    model: dict,
    seed: int,
    blocks_per_stage: list[int],
    num_microbatches: int,
    loss: str,
    mesh: dict,
    inputs=None,
    targets=None,
    schedule: str = "1f1b",
    clip: dict | None = None,
    group=None,
) -> dict:
    """Data, tensor and pipeline parallelism on one pp x dp x tp mesh (reference/mesh.py, ``Mesh``;
    ``mesh`` carries its groups: {"pp": [...], "dp": [...], "tp": [...]}, every rank creates all of
    them in that order). This rank's stage s is its pipeline group position; its blocks
    (harness/rank/pipeline_models.py, ``build_blocks``) become the implementation's
    ``TensorParallelMLP`` on its tensor-parallel group, and that stack runs in the implementation's
    ``pipeline_step`` on its pipeline group (its replica's inputs on the first stage, targets on the
    last, whole on every tensor-parallel rank); then every gradient shard is summed over its
    data-parallel group with the implementation's ``all_reduce`` and divided by its size. Returns
    the loss (None off the last stage), the gradient shards keyed ``stage<s>.<block>.<fc>.<weight|bias>``,
    the order run and the stage. ``clip`` ({"max_norm", "norm_type"}, capability mesh_clipping): the
    averaged shards are put back as the gradients and the implementation's ``clip_grad_norm_(stage,
    max_norm, norm_type, pp_group=<the pipeline group>)`` runs; its result is reported as "norm" and
    the shards reported clipped."""
    from torch import nn
    from torch.distributed import ReduceOp

    if group is not None:
        raise ValueError("a mesh spans the whole world")
    recording.mark("setup")  # phases for the audit (no-ops outside an audited world)
    for axis in ("tp", "dp", "pp"):
        for members in mesh[axis]:
            ctx.group(members)
    mine = {axis: next(g for g in mesh[axis] if ctx.rank in g) for axis in ("pp", "dp", "tp")}
    pp, dp, tp = (ctx.group(mine[axis]) for axis in ("pp", "dp", "tp"))
    stage = mine["pp"].index(ctx.rank)
    stages = pipeline_models.split(pipeline_models.build_blocks(model, seed).to(ctx.device), blocks_per_stage)
    mlp = require(impl, "TensorParallelMLP")
    blocks = [mlp.from_dense(block.fc1, block.fc2, group=tp) for block in stages[stage]]
    module = nn.Sequential(*blocks)
    executed = watch([stage], [module])
    pipeline_step, all_reduce = require(impl, "pipeline_step"), require(impl, "all_reduce")
    recording.mark("pipeline")
    result = pipeline_step(
        module, ctx.to_device(inputs), ctx.to_device(targets), pipeline_models.loss_fn(loss), num_microbatches, schedule=schedule, group=pp
    )
    recording.mark("data_parallel")
    grads = {}
    for b, block in enumerate(blocks):
        for fc in ("fc1", "fc2"):
            for kind in ("weight", "bias"):
                parameter = getattr(getattr(block, fc), kind, None)
                if parameter is None or parameter.grad is None:
                    continue
                local = parameter.grad.detach()
                local = local.to_local() if hasattr(local, "to_local") else local
                shard = local.clone().contiguous()
                all_reduce(shard, op=ReduceOp.SUM, group=dp)
                grads[f"stage{stage}.{b}.{fc}.{kind}"] = shard / len(mine["dp"])
                if clip is not None:  # the trainer's averaged gradient, in place (a DTensor's local shard)
                    local.copy_(grads[f"stage{stage}.{b}.{fc}.{kind}"])
    recording.mark("after")
    norm = None
    if clip is not None:
        pipeline = pp if pp is not None else dist.group.WORLD  # a pipeline spanning the world is still one
        norm = require(impl, "clip_grad_norm_")(module, clip["max_norm"], clip["norm_type"], pp_group=pipeline)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        norm = norm.detach().clone() if torch.is_tensor(norm) else norm
        for b, block in enumerate(blocks):
            for fc in ("fc1", "fc2"):
                for kind in ("weight", "bias"):
                    parameter = getattr(getattr(block, fc), kind, None)
                    if parameter is not None and parameter.grad is not None:
                        clipped = parameter.grad.detach()
                        grads[f"stage{stage}.{b}.{fc}.{kind}"] = (clipped.to_local() if hasattr(clipped, "to_local") else clipped).clone()
    return ctx.to_cpu({"loss": result, "grads": grads, "executed": executed, "stage": stage, "norm": norm})
