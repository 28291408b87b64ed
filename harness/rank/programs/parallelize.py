"""Rank program for ``--parallelize`` (capability ``parallelize``): a team's function
``parallelize(model, mesh) -> model`` applied to the suite's small decoder LM
(harness/rank/decoder_lm.py) on a named DeviceMesh, then K optimizer steps. Programs never judge:
this one returns plain CPU tensors and strings, and the driver (conformance/test_parallelize.py)
compares them with one process training the dense twin. A function of torchtitan's form
(``function.form = "torchtitan"``) is called ``function(model, parallel_dims, job_config)`` with
torchtitan's own ParallelDims and config sections (harness/rank/torchtitan_form.py), and the model
may be torchtitan's Llama (harness/rank/parallelize_models.py).

Per rank: the mesh ``init_device_mesh(device type, sizes, mesh_dim_names=names)`` over the whole
world (every declared dimension, of size 1 too, so ``mesh["tp"]`` always exists); the model built
from the spec and seed, bitwise what the driver builds; ``function(model, mesh)``, whose return
value is the model trained (an nn.Module, else a TypeError naming what came back; a wrapper's
parts of the names, WRAPPERS, taken out); the optimizer
over its parameters (DTensors where the plan made them so). Each step: zero_grad(set_to_none=True),
logits of this rank's rows (the driver gave it its data-parallel share; tensor-parallel peers get
the same rows), cross entropy, ``loss * scale`` backward, then every gradient and, after
``optimizer.step()``, every parameter gathered whole (``DTensor.full_tensor()``, a collective every
rank joins; a plain tensor is this rank's own copy). ``scale`` None: the loss is the mean over
the rank's tokens; else the cross entropy summed times ``scale`` = dp / N, N the global batch's
valid tokens (the gradient the plan averages over dp is then the global token mean's).

Returns {"losses": [the loss this rank backpropagated, per step], "grads": [{name: tensor | None}],
"params": [{name: tensor}] (after each step), "initial": {name: tensor} (after the plan, before
the first step; a model whose parameter names are not the dense model's is returned here, untrained),
"placements": {name: {mesh dim: placement}} ({} for a plain tensor),
"forward": [[module path, output]] in the order the first step's forward ran them (DTensor outputs
gathered, a tuple's first tensor, anything else skipped), "memory": what the rank holds after the
first step (``held``; conformance/parallelize_memory.py judges it)}."""

from __future__ import annotations

import importlib
import os

import torch
import torch.nn.functional as F
from torch import nn

from parallelism_conformance.harness.rank import models, parallelize_models, recording, torchtitan_form
from parallelism_conformance.harness.rank.context import RankContext
from parallelism_conformance.harness.rank.loader import load_implementation

_LOADED: dict = {}  # a PATH.py's absolute path -> its module, once loaded whole


def load_function(spec: str, base: str | None = None):
    """``module:function`` or ``path/to/file.py:function`` (relative to ``base``): the function, or
    an ImportError / AttributeError that names the spec."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--parallelize {spec!r}: expected MODULE:FUNCTION or PATH.py:FUNCTION")
    if where.endswith(".py"):
        # loaded once per process: each example would run the file again, and put its folder on sys.path again;
        # only a whole load is kept (a module that raised stays half made in sys.modules: it is loaded again, and says why again)
        path = os.path.abspath(os.path.join(base or os.getcwd(), where))
        module = _LOADED[path] = _LOADED.get(path) or load_implementation(where, base)
    else:
        module = importlib.import_module(where)
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"--parallelize {spec!r}: {where} has no {name!r}") from None


# what wrappers insert into names: DistributedDataParallel's "module.", activation checkpointing's
# checkpoint_wrapper, torch.compile's OptimizedModule
WRAPPERS = ("module", "_checkpoint_wrapped_module", "_orig_mod")


def plain_name(name: str) -> str:
    """A parameter's or module's name with the wrappers' parts taken out (the dense model's name)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def whole(tensor):
    """A DTensor gathered whole (a collective), anything else as it is; detached."""
    if tensor is None:
        return None
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().clone()


def placements(parameter) -> dict:
    """{mesh dim name: repr(placement), "Shard(dim=0)"} of a DTensor parameter; {} for a plain tensor."""
    if not hasattr(parameter, "placements"):
        return {}
    names = parameter.device_mesh.mesh_dim_names or tuple(str(i) for i in range(parameter.device_mesh.ndim))
    return {name: repr(p) for name, p in zip(names, parameter.placements)}


def _tensor(t) -> dict:
    """{"shape": global shape, "itemsize", "local": numel x itemsize of this rank's local tensor
    (``to_local()`` of a DTensor; a view's own elements, not the storage it views), "placements",
    "sizes": {mesh dim: size}} of a tensor or DTensor."""
    local = t.to_local() if hasattr(t, "to_local") else t
    out = {"shape": list(t.shape), "itemsize": t.element_size(), "local": local.numel() * local.element_size()}
    if hasattr(t, "device_mesh"):
        mesh = t.device_mesh
        names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
        out.update(placements=placements(t), sizes=dict(zip(names, mesh.shape)))
    else:
        out.update(placements={}, sizes={})
    return out


def held(model: nn.Module, optimizer) -> dict:
    """What this rank holds, plain data: {"params": {name: _tensor}, "grads": {name: _tensor | None},
    "optimizer": {name: [_tensor of each state tensor, AdamW's step too]}, "buffers": {name: _tensor}}."""
    named = {plain_name(name): p for name, p in model.named_parameters()}
    state = lambda p: [_tensor(v) for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return {
        "params": {name: _tensor(p) for name, p in named.items()},
        "grads": {name: None if p.grad is None else _tensor(p.grad) for name, p in named.items()},
        "optimizer": {name: state(p) for name, p in named.items()},
        "buffers": {plain_name(name): _tensor(b) for name, b in model.named_buffers()},
    }


def _record_forward(model: nn.Module, record: list) -> list:
    def hook(path):
        def run(module, args, output):
            first = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(first, torch.Tensor):
                phase = recording.phase()
                recording.mark("harness")  # a sharded output gathered for the report: not the plan's traffic
                record.append([plain_name(path) or "(root)", whole(first)])
                recording.mark(phase)

        return run

    return [module.register_forward_hook(hook(path)) for path, module in model.named_modules()]


def parallelize_steps(
    ctx: RankContext,
    impl,
    function: str,
    mesh: list,
    model: dict,
    seed: int,
    optimizer: dict,
    steps: int,
    inputs,
    targets,
    scale: float | None = None,
    base: str | None = None,
    form: str = "mesh",
    model_kind: str = "decoder",
    group=None,
) -> dict:
    """See the module docstring. ``mesh``: [[dim name, size], ...] in order, sizes multiplying to
    the world size; ``scale``: None for each rank's mean loss, else the factor of its summed loss;
    ``form``: "mesh" (``function(model, mesh)``) or "torchtitan" (``function(model, parallel_dims,
    job_config)``, harness/rank/torchtitan_form.py); ``model_kind``: harness/rank/parallelize_models.py's."""
    if group is not None:
        raise ValueError("a mesh spans the whole world")
    parallelize = load_function(function, base)
    dense = parallelize_models.build(model_kind, model, seed).to(ctx.device)
    names = {name for name, _ in dense.named_parameters()}  # before the plan: it may replace modules
    if form == torchtitan_form.FORM:
        rows, seq = inputs.shape
        args = (torchtitan_form.parallel_dims(ctx, mesh), torchtitan_form.job_config(mesh, seq, rows))
        called = f"{function}(model, parallel_dims, job_config)"
    else:
        args, called = (ctx.device_mesh(mesh),), f"{function}(model, mesh)"  # made once per world (RankContext.device_mesh says why)
    recording.mark("plan")  # labels for the traffic per mesh dimension (conformance/parallelize_traffic.py)
    try:
        trained = parallelize(dense, *args)
    except Exception as error:  # the plan's own error (a mesh it cannot take): said so, then the rank's traceback
        error.add_note(f"raised by {called} on the mesh {mesh}, before any step")
        raise
    if not isinstance(trained, nn.Module):
        raise TypeError(f"{function} returned {type(trained).__name__}, not the model (an nn.Module)")
    named = {plain_name(name): p for name, p in trained.named_parameters()}
    recording.mark("harness")  # the harness's own gathers: not the plan's traffic
    out = {
        "initial": {name: whole(p) for name, p in named.items()},
        "placements": {name: placements(p) for name, p in named.items()},
        "losses": [],
        "grads": [],
        "params": [],
        "forward": [],
    }
    if set(named) != names:  # another model: not trained (its forward may not take tokens); the driver names what differs
        return ctx.to_cpu(out)
    opt = models.build_optimizer(optimizer, trained.parameters())
    x, y = ctx.to_device(inputs), ctx.to_device(targets)
    for step in range(steps):
        hooks = _record_forward(trained, out["forward"]) if step == 0 else []
        opt.zero_grad(set_to_none=True)
        recording.mark("forward")
        logits = trained(x)
        for handle in hooks:
            handle.remove()
        recording.mark("harness")  # the logits gathered whole for the loss, which the harness owns
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        flat, labels = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        loss = F.cross_entropy(flat, labels) if scale is None else F.cross_entropy(flat, labels, reduction="sum") * scale
        recording.mark("backward")
        loss.backward()
        recording.mark("harness")
        out["losses"].append(whole(loss))
        out["grads"].append({name: whole(p.grad) for name, p in named.items()})
        recording.mark("step")
        opt.step()
        recording.mark("harness")
        out["params"].append({name: whole(p) for name, p in named.items()})
        if step == 0:
            out["memory"] = held(trained, opt)
    return ctx.to_cpu(out)
