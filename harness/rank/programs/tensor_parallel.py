"""Rank programs for tensor parallelism: build the dense layers from the weights the driver sends
(the same on every rank: inputs, not expected values), wrap them with the implementation's class,
run forward on this rank's input and backward with this rank's upstream gradient (the driver
slices both per layout and sends each rank only its part), and return what the driver judges.

The contract (CONTRACT.md, "Tensor parallelism"), for a group of n ranks (``group=None``: the world):

* ``ColumnParallelLinear.from_dense(linear, group=None, gather_output=False)``: every rank passes
  the same dense ``nn.Linear(in, out)`` and keeps rows r of its weight (out_features split in n
  contiguous chunks) and the same chunk of its bias. Input: the full x [..., in] (the same on every
  rank). Output: this rank's slice of the out_features (last dim), or with gather_output=True the
  full output on every rank. x.grad: the full dL/dx on every rank.
* ``RowParallelLinear.from_dense(linear, group=None, input_is_parallel=True)``: keeps columns r of
  the weight (in_features split) and the whole bias on every rank. Input: this rank's slice of the
  in_features (last dim), or with input_is_parallel=False the full x, which it slices itself.
  Output: the full output on every rank (all-reduced; the bias added once). x.grad: the gradient of
  what this rank was given (its slice, or the full dL/dx). bias.grad: the full dL/db on every rank.
* ``TensorParallelMLP.from_dense(fc1, fc2, group=None, sequence_parallel=False)``, fc1 =
  ``nn.Linear(h, f)``, fc2 = ``nn.Linear(f, h)``, exact GELU between; ``.fc1`` is column parallel,
  ``.fc2`` row parallel. Input and output: the full [..., h], replicated; with sequence_parallel
  this rank's contiguous shard of the sequence (dim -2) of [..., seq, h] in and out.
* All three are nn.Modules whose ``.weight`` and ``.bias`` (None without bias) are parameters
  holding this rank's shard (the whole bias for the row layer); after backward their ``.grad`` is
  this rank's slice of the dense gradient. A DTensor parameter is judged by its local shard.
  What every member holds whole is bitwise identical on every member.
* out_features (column), in_features (row), the ffn width f (MLP) not divisible by n: ValueError
  from from_dense whose message names the dimension ("out_features", "in_features", "ffn"), its
  size and n, raised before any communication.
* A class that is missing or raises NotImplementedError fails every tensor-parallel test as "not
  implemented" (CONTRACT.md); nothing is skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelism_conformance.harness.rank import models
from parallelism_conformance.harness.rank.context import MissingFunction, RankContext, on_members, require

CLASSES = {"column": "ColumnParallelLinear", "row": "RowParallelLinear", "mlp": "TensorParallelMLP"}


def _dense(ctx: RankContext, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, dtype=weight.dtype, device=ctx.device)
    with torch.no_grad():
        linear.weight.copy_(ctx.to_device(weight))
        if bias is not None:
            linear.bias.copy_(ctx.to_device(bias))
    return linear


def _norm(ctx: RankContext, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> nn.LayerNorm:
    norm = nn.LayerNorm(weight.shape[0], eps=eps, dtype=weight.dtype, device=ctx.device)
    with torch.no_grad():
        norm.weight.copy_(ctx.to_device(weight))
        norm.bias.copy_(ctx.to_device(bias))
    return norm


def _local(t):
    """A tensor, or the local shard of a DTensor (what this rank holds)."""
    if t is None:
        return None
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _build(ctx: RankContext, impl, process_group, layer: str, dense: dict, options: dict) -> nn.Module:
    cls = require(impl, CLASSES[layer])
    if layer == "mlp":
        fc1 = _dense(ctx, dense["fc1_weight"], dense["fc1_bias"])
        fc2 = _dense(ctx, dense["fc2_weight"], dense["fc2_bias"])
        if "norm_weight" in dense:  # the pre-norm block (capability tp_norm): passed only then
            options = {**options, "norm": _norm(ctx, dense["norm_weight"], dense["norm_bias"], dense["norm_eps"])}
        return cls.from_dense(fc1, fc2, group=process_group, **options)
    return cls.from_dense(_dense(ctx, dense["weight"], dense["bias"]), group=process_group, **options)


def _after_backward(module: nn.Module) -> None:
    """``module.finish_gradient_synchronization()`` where the module has one (optional, CONTRACT.md:
    megatron-core's finalize step, which sums the gradients of the parameters that met only a sequence
    shard); nothing otherwise."""
    hook = getattr(module, "finish_gradient_synchronization", None)
    if callable(hook):
        hook()


def _gradient(parameter):
    """``parameter.grad`` laid out as the parameter is. torch 2.13's DTensor leaves some gradients in
    another placement than their parameter's, to be reduced when used: a replicated LayerNorm under
    ``SequenceParallel`` gets a Partial(sum) gradient, and a row-sharded embedding a replicated one.
    What a rank holds of the parameter's gradient is then the gradient redistributed to the
    parameter's placements (an all-reduce, or a local slice), every rank in the same order."""
    grad = parameter.grad
    if grad is not None and hasattr(grad, "redistribute") and grad.placements != parameter.placements:
        grad = grad.redistribute(placements=parameter.placements)
    return grad


def _parameters(module: nn.Module, layer: str) -> dict:
    """{name: (parameter, gradient)} as this rank holds them."""
    owners = {"fc1_": module.fc1, "fc2_": module.fc2} if layer == "mlp" else {"": module}
    if layer == "mlp" and getattr(module, "norm", None) is not None:
        owners["norm_"] = module.norm
    result = {}
    for prefix, owner in owners.items():
        for name in ("weight", "bias"):
            p = getattr(owner, name, None)
            result[prefix + name] = _local(p)
            result["grad_" + prefix + name] = None if p is None else _local(_gradient(p))
    return result


@on_members
def forward_backward(
    ctx: RankContext,
    impl,
    process_group,
    layer: str,
    dense: dict,
    options: dict,
    x: torch.Tensor,
    grad_output: torch.Tensor,
    rng_seed: int | None = None,
) -> dict:
    """``layer`` in column, row, mlp; ``dense`` the dense weights; ``options`` the keyword arguments
    of from_dense. Returns output, grad_input, and every parameter's shard and its gradient (keys
    weight, bias, grad_weight, grad_bias, prefixed fc1_/fc2_ for the MLP, and norm_ for its
    LayerNorm when ``dense`` has one: built from norm_weight, norm_bias, norm_eps and passed as
    ``norm``). ``rng_seed``: torch's default generator is seeded with it, on every member alike,
    just before the forward (the dropout masks' stream)."""
    module = _build(ctx, impl, process_group, layer, dense, options)
    x = ctx.to_device(x).requires_grad_(True)
    if rng_seed is not None:
        torch.manual_seed(rng_seed)
    y = module(x)
    y.backward(ctx.to_device(grad_output))
    _after_backward(module)
    return ctx.to_cpu({"output": _local(y), "grad_input": x.grad, **_parameters(module, layer)})


@on_members
def train_steps(
    ctx: RankContext, impl, process_group, dense: dict, options: dict, x: torch.Tensor, grad_output: torch.Tensor, optimizer: dict, steps: int
) -> dict:
    """The MLP (with its LayerNorm when ``dense`` has one) trained ``steps`` times on the linear loss
    sum(y * grad_output) of this member's output, the optimizer ``optimizer`` (harness.rank.models)
    over the module's parameters as this member holds them: each step's loss."""
    module = _build(ctx, impl, process_group, "mlp", dense, options)
    opt = models.build_optimizer(optimizer, [p for p in module.parameters() if p.requires_grad])
    x, g = ctx.to_device(x), ctx.to_device(grad_output)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        y = module(x)
        loss = ((y.to_local() if hasattr(y, "to_local") else y) * g).sum()
        loss.backward()
        _after_backward(module)
        opt.step()
        losses.append(loss.detach())
    return ctx.to_cpu({"losses": torch.stack(losses)})


@on_members
def clip(ctx: RankContext, impl, process_group, dense: dict, options: dict, x: torch.Tensor, grad_output: torch.Tensor, clip: dict) -> dict:
    """The MLP's forward and backward as ``forward_backward``, then the implementation's
    ``clip_grad_norm_(module, max_norm, norm_type)``: what it returned (a DTensor's full value) and
    every parameter's shard and clipped gradient."""
    module = _build(ctx, impl, process_group, "mlp", dense, options)
    x = ctx.to_device(x).requires_grad_(True)
    module(x).backward(ctx.to_device(grad_output))
    _after_backward(module)
    norm = require(impl, "clip_grad_norm_")(module, clip["max_norm"], clip["norm_type"])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return ctx.to_cpu({"norm": norm.detach().clone() if torch.is_tensor(norm) else norm, **_parameters(module, "mlp")})


@on_members
def vocab_embedding(ctx: RankContext, impl, process_group, weight: torch.Tensor, tokens: torch.Tensor, grad_output: torch.Tensor) -> dict:
    """The implementation's ``VocabParallelEmbedding.from_dense`` of the dense table ``weight``,
    forward on the tokens (the same on every rank), backward with the upstream gradient: the
    output, and this rank's rows of the table and their gradient."""
    dense = nn.Embedding(*weight.shape, dtype=weight.dtype, device=ctx.device)
    with torch.no_grad():
        dense.weight.copy_(ctx.to_device(weight))
    module = require(impl, "VocabParallelEmbedding").from_dense(dense, group=process_group)
    output = module(ctx.to_device(tokens))
    output.backward(ctx.to_device(grad_output))
    return ctx.to_cpu({"output": _local(output), "weight": _local(module.weight), "grad_weight": _local(_gradient(module.weight))})


@on_members
def vocab_cross_entropy(
    ctx: RankContext,
    impl,
    process_group,
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    grad_output: torch.Tensor,
    label_smoothing: float = 0.0,
) -> dict:
    """The implementation's ``vocab_parallel_cross_entropy`` on this rank's logit columns, then
    backward with the upstream gradient: the per-token losses and the gradient of the columns.
    ``label_smoothing`` is passed only when drawn (nonzero), so the plain call stays the contract's
    four arguments."""
    function = require(impl, "vocab_parallel_cross_entropy")
    logits = ctx.to_device(logits).requires_grad_(True)
    smoothing = {"label_smoothing": label_smoothing} if label_smoothing else {}
    loss = function(logits, ctx.to_device(targets), vocab_size, group=process_group, **smoothing)
    loss.backward(ctx.to_device(grad_output))
    return ctx.to_cpu({"loss": _local(loss), "grad_logits": logits.grad})


@on_members
def refusal(ctx: RankContext, impl, process_group, layer: str, dense: dict, options: dict, x: torch.Tensor) -> dict:
    """Build and run forward on sizes that do not split: what was raised, if anything."""
    try:
        module = _build(ctx, impl, process_group, layer, dense, options)
        module(ctx.to_device(x))
    except (MissingFunction, NotImplementedError):  # not implemented: the harness reports it
        raise
    except Exception as error:  # noqa: BLE001 - the driver judges what was raised
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None, "message": ""}
