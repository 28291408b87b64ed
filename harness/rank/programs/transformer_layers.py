"""Rank programs for the tensor-parallel layers of a transformer block (CONTRACT.md, "Tensor-parallel
attention and SwiGLU"): build the dense layers from the weights the driver sends (the same on every
rank), wrap them with the implementation's class, run forward on this rank's input and backward
with this rank's upstream gradient, and return what the driver judges.

* ``TensorParallelAttention.from_dense(qkv, out, num_heads, num_kv_heads, group=None,
  sequence_parallel=False, qkv_layout="concatenated")``: ``.qkv`` column parallel (this rank's heads'
  rows of the fused weight, in the layout for its own head counts), ``.out`` row parallel;
  causal self-attention on [batch, seq, h].
* ``TensorParallelSwiGLU.from_dense(gate_up, down, group=None, sequence_parallel=False)``:
  ``.gate_up`` column parallel ([gate_r | up_r]), ``.down`` row parallel.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelism_conformance.harness.rank.context import MissingFunction, RankContext, on_members, require
from parallelism_conformance.harness.rank.programs.tensor_parallel import _dense, _gradient, _local

CLASSES = {"attention": ("TensorParallelAttention", ("qkv", "out")), "swiglu": ("TensorParallelSwiGLU", ("gate_up", "down"))}


def _build(ctx: RankContext, impl, process_group, layer: str, dense: dict, options: dict) -> nn.Module:
    name, parts = CLASSES[layer]
    linears = [_dense(ctx, dense[f"{part}_weight"], dense[f"{part}_bias"]) for part in parts]
    return require(impl, name).from_dense(*linears, group=process_group, **options)


def _parameters(module: nn.Module, layer: str) -> dict:
    """{name: shard, grad_name: its gradient} for the weight and bias of each part, as this rank holds them."""
    result = {}
    for part in CLASSES[layer][1]:
        owner = getattr(module, part, None)
        for name in ("weight", "bias"):
            p = getattr(owner, name, None)
            result[f"{part}_{name}"] = _local(p)
            result[f"grad_{part}_{name}"] = None if p is None else _local(_gradient(p))
    return result


@on_members
def forward_backward(
    ctx: RankContext, impl, process_group, layer: str, dense: dict, options: dict, x: torch.Tensor, grad_output: torch.Tensor
) -> dict:
    """``layer``: attention or swiglu; ``dense``: <part>_weight and <part>_bias of the dense layers;
    ``options``: the other keyword arguments of from_dense. Returns output, grad_input and each
    part's shards and their gradients."""
    module = _build(ctx, impl, process_group, layer, dense, options)
    x = ctx.to_device(x).requires_grad_(True)
    y = module(x)
    y.backward(ctx.to_device(grad_output))
    return ctx.to_cpu({"output": _local(y), "grad_input": x.grad, **_parameters(module, layer)})


@on_members
def refusal(ctx: RankContext, impl, process_group, layer: str, dense: dict, options: dict) -> dict:
    """Build on sizes the contract refuses: what was raised, if anything."""
    try:
        _build(ctx, impl, process_group, layer, dense, options)
    except (MissingFunction, NotImplementedError):  # not implemented: the harness reports it
        raise
    except Exception as error:  # noqa: BLE001 - the driver judges what was raised
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None, "message": ""}
