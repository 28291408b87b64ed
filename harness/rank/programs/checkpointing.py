"""Rank programs for checkpoints that reshard (CONTRACT.md, "Checkpoints that reshard"): ``save``
trains under one data-parallel layout and saves; ``resume`` loads that checkpoint under another
layout and world size and trains on. The checkpoint travels as plain data through the driver
({relative path: bytes}, the union of what the saving world wrote: a shared filesystem), so
contained worlds, each in a private directory, stay contained, and the suite never reads the format.

A layout is ``fully_sharded`` (``fully_shard`` on the units, then the root; a torch optimizer over
the pieces), ``sharded_optimizer`` (the whole model; ``ShardedOptimizer``) or ``tensor_parallel``
(the ``gelu_mlp`` model's block replaced by ``TensorParallelMLP.from_dense(fc1, fc2)`` over the
world; a torch optimizer over its shards) or ``pipeline`` (a pp x dp mesh of the ``stacked_mlp``
model's stages under its names, ``pipeline_step`` then the implementation's ``all_reduce`` over each
stage's replicas; a torch optimizer over the stage). Every step: one zero_grad, one forward and backward on
this rank's slice of the global batch (the whole batch under tensor parallelism: one replica), one
optimizer step. The state reported is every full parameter and buffer by name, under tensor
parallelism every local tensor by name (a DTensor's local shard), which the driver puts together."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallelism_conformance.harness.rank import models
from parallelism_conformance.harness.rank.context import RankContext, require
from parallelism_conformance.harness.rank.programs.fully_sharded import sharded_model

LAYOUTS = ("fully_sharded", "sharded_optimizer", "tensor_parallel", "pipeline")
MAX_CHECKPOINT_BYTES = 64 << 20  # the models are tiny: a checkpoint larger than this is a runaway


class _Layout:
    """A model and its optimizer under one layout, and the state of the model this rank reports."""

    def __init__(self, ctx: RankContext, impl, layout: str, model: dict, seed: int, optimizer: dict, mesh: dict | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
        self.layout, self.impl = layout, impl
        if layout == "fully_sharded":
            self.full_parameters = require(impl, "full_parameters")
            self.net = sharded_model(ctx, impl, model, seed)
            self.opt = models.build_optimizer(optimizer, self.net.parameters())
        elif layout == "tensor_parallel":
            self.net = models.build(model, seed).to(ctx.device)
            if not hasattr(self.net, "mlp"):
                raise ValueError(f"the tensor-parallel layout takes the gelu_mlp model, not {model['kind']!r}")
            self.net.mlp = require(impl, "TensorParallelMLP").from_dense(self.net.mlp.fc1, self.net.mlp.fc2)
            self.opt = models.build_optimizer(optimizer, self.net.parameters())
        elif layout == "pipeline":
            self._pipeline(ctx, model, seed, optimizer, mesh)
        else:
            self.net = models.build(model, seed).to(ctx.device)
            optimizer_class, options = models.optimizer_class(optimizer)
            self.opt = require(impl, "ShardedOptimizer")(self.net.parameters(), optimizer_class, **options)

    def _pipeline(self, ctx: RankContext, model: dict, seed: int, optimizer: dict, mesh: dict) -> None:
        """A pp x dp mesh, the pipeline axis outermost (rank s dp + d holds stage s of replica d):
        every group made on every rank in the same order, this rank's stage under the model's names."""
        pp, dp = mesh["pp"], mesh["dp"]
        pipes = [[s * dp + d for s in range(pp)] for d in range(dp)]
        replicas = [[s * dp + d for d in range(dp)] for s in range(pp)]
        groups = {tuple(members): ctx.group(members) for members in [*pipes, *replicas]}
        self.stage, replica = divmod(ctx.rank, dp)
        self.pp, self.dp, self.microbatches = pp, dp, mesh["microbatches"]
        self.pipe_group, self.dp_group = groups[tuple(pipes[replica])], groups[tuple(replicas[self.stage])]
        self.net = models.stage_of(models.build(model, seed), self.stage, pp).to(ctx.device)
        self.opt = models.build_optimizer(optimizer, self.net.parameters())

    def state(self) -> dict:
        if self.layout == "fully_sharded":
            values = {name: t.detach().clone() for name, t in self.full_parameters(self.net).items()}
            values.update({name: b.detach().clone() for name, b in self.net.named_buffers()})
            return values
        if self.layout == "tensor_parallel":
            return {
                name: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()
                for name, t in [*self.net.named_parameters(), *self.net.named_buffers()]
            }
        return models.state(self.net)  # ZeRO-1: the whole model; a pipeline: this rank's stage

    def train(self, steps: int, inputs, targets) -> list[dict]:
        states = []
        for _ in range(steps):
            self.opt.zero_grad(set_to_none=True)
            if self.layout == "pipeline":
                self._pipeline_step(inputs, targets)
            else:
                self.net(inputs, targets).backward()
            self.opt.step()
            states.append(self.state())
        return states

    def _pipeline_step(self, inputs, targets) -> None:
        """The replica's pipeline_step (its loss the mean over its microbatches), then each stage
        gradient averaged over the stage's data-parallel group with the implementation's all_reduce."""
        require(self.impl, "pipeline_step")(
            self.net,
            inputs if self.stage == 0 else None,
            targets if self.stage == self.pp - 1 else None,
            F.mse_loss,
            self.microbatches,
            schedule="1f1b",
            group=self.pipe_group,
        )
        all_reduce = require(self.impl, "all_reduce")
        for parameter in self.net.parameters():
            if parameter.grad is not None and self.dp > 1:
                all_reduce(parameter.grad, group=self.dp_group)
                parameter.grad.div_(self.dp)


def _directory(token: str, *parts: str) -> str:
    """A directory of this task under the rank's temporary directory (the world's private one when
    contained); ``token`` comes from the driver, so every rank of the world names the same one."""
    if not token.isalnum():
        raise ValueError(f"a checkpoint token must be alphanumeric, got {token!r}")
    return os.path.join(tempfile.gettempdir(), f"conformance-checkpoint-{token}", *parts)


def _read_tree(root: str) -> dict[str, bytes]:
    """{path relative to ``root``: bytes} of every file under it."""
    files, total = {}, 0
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if os.path.islink(path) or not os.path.isfile(path):
                raise ValueError(f"the checkpoint holds {os.path.relpath(path, root)!r}, which is not a plain file")
            with open(path, "rb") as file:
                data = files[os.path.relpath(path, root)] = file.read()
            total += len(data)
            if total > MAX_CHECKPOINT_BYTES:
                raise ValueError(f"the checkpoint is over {MAX_CHECKPOINT_BYTES} bytes")
    return files


def _write_tree(root: str, files: dict[str, bytes]) -> str:
    for relative, data in files.items():
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as file:
            file.write(data)
    os.makedirs(root, exist_ok=True)
    return root


def save(
    ctx: RankContext,
    impl,
    layout: str,
    model: dict,
    seed: int,
    optimizer: dict,
    steps: int,
    batch: dict,
    token: str,
    rng_seed: int | None = None,
    mesh: dict | None = None,
    group=None,
) -> dict:
    """Train ``steps`` steps under ``layout``, then ``save_checkpoint``. Every rank reports its state
    after the steps; rank 0 also the files every rank wrote, read once all have returned. With
    ``rng_seed``, each rank seeds torch's default generator with ``rng_seed`` + its rank just before
    the save and reports the generator's state then (the stream a resume must continue)."""
    if group is not None:
        raise ValueError("checkpoints are tested on the whole world, not a subgroup")
    save_checkpoint = require(impl, "save_checkpoint")
    run = _Layout(ctx, impl, layout, model, seed, optimizer, mesh)
    inputs, targets = ctx.to_device(batch["inputs"]), ctx.to_device(batch["targets"])
    states = run.train(steps, inputs, targets)
    path = _directory(token, "saved")
    result = {"state": states[-1]}
    if rng_seed is not None:
        torch.manual_seed(rng_seed + ctx.rank)
        result["rng"] = torch.get_rng_state()
    save_checkpoint(path, run.net, run.opt)
    dist.barrier()  # the harness's own: every rank's save_checkpoint has returned
    if ctx.rank == 0:
        result["files"] = _read_tree(path) if os.path.isdir(path) else {}
        shutil.rmtree(_directory(token), ignore_errors=True)
    return ctx.to_cpu(result)


def _attempt(ctx: RankContext, impl, layout: str, model: dict, seed: int, optimizer: dict, path: str, mesh: dict | None) -> dict:
    """Build ``model`` under ``layout`` and load ``path`` into it: {"raised": text} or {"loaded": the
    full state}. Whether to read the state back (a collective) is agreed by all ranks first, so a
    rank that raised never leaves the others waiting in full_parameters."""
    load_checkpoint = require(impl, "load_checkpoint")
    run = _Layout(ctx, impl, layout, model, seed, optimizer, mesh)
    try:
        load_checkpoint(path, run.net, run.opt)
        outcome = {}
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as error:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        outcome = {"raised": f"{type(error).__name__}: {error}"[:400]}
    flag = torch.tensor([1 if "raised" in outcome else 0], device=ctx.device)  # NCCL takes CUDA tensors only
    dist.all_reduce(flag)  # the harness's own agreement, on torch.distributed
    if int(flag) == 0:
        outcome["loaded"] = run.state()
    return outcome


def resume(
    ctx: RankContext,
    impl,
    layout: str,
    model: dict,
    seed: int,
    optimizer: dict,
    steps: int,
    batch: dict,
    files: dict[str, bytes],
    token: str,
    other_model: dict,
    dropped: str,
    rng_seed: int | None = None,
    mesh: dict | None = None,
    group=None,
) -> dict:
    """With the saved ``files``: load them into ``other_model`` (another architecture: must raise),
    then without the file ``dropped`` (must raise or load exactly), each on fresh objects; then load
    them into ``model`` under ``layout`` (built from ``seed``, not the saved one's) and train
    ``steps`` steps. Each rank writes its own copy of the files (one shared filesystem, as far as
    reading goes). With ``rng_seed``, each rank seeds torch's default generator with ``rng_seed`` +
    its rank (another stream than the saved one) before the load and reports its state after it."""
    if group is not None:
        raise ValueError("checkpoints are tested on the whole world, not a subgroup")
    root = _directory(token, f"rank{ctx.rank}")
    try:
        whole = _write_tree(os.path.join(root, "whole"), files)
        cut = _write_tree(os.path.join(root, "cut"), {k: v for k, v in files.items() if k != dropped})
        result = {
            "other_architecture": _attempt(ctx, impl, layout, other_model, seed, optimizer, whole, mesh),
            "missing_file": _attempt(ctx, impl, layout, model, seed, optimizer, cut, mesh),
        }
        run = _Layout(ctx, impl, layout, model, seed, optimizer, mesh)
        if rng_seed is not None:
            torch.manual_seed(rng_seed + ctx.rank)
        require(impl, "load_checkpoint")(whole, run.net, run.opt)
        if rng_seed is not None:
            result["rng"] = torch.get_rng_state()
        result["loaded"] = run.state()
        inputs, targets = ctx.to_device(batch["inputs"]), ctx.to_device(batch["targets"])
        result["states"] = run.train(steps, inputs, targets)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return ctx.to_cpu(result)
