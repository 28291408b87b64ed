"""Rank program for parallelisms composed on a device mesh (reference/mesh.py): tensor parallelism
inside each row of a dp x tp mesh, data parallelism down each column.

Every rank builds the implementation's TensorParallelMLP over its tensor-parallel group from the
dense weights the driver sends, runs forward on its replica's rows of the batch and backward with
their upstream gradient, then sums each gradient shard over its data-parallel group with the
implementation's all_reduce. The driver sends the mesh's groups; every rank creates all of them,
in the same order, as torch.distributed.new_group requires."""

from __future__ import annotations

from torch.distributed import ReduceOp

from parallelism_conformance.harness.rank import recording
from parallelism_conformance.harness.rank.context import RankContext, require
from parallelism_conformance.harness.rank.programs.tensor_parallel import _dense, _local, _parameters


def dp_tp_mlp(
    ctx: RankContext,
    impl,
    tensor_parallel_groups: list[list[int]],
    data_parallel_groups: list[list[int]],
    dense: dict,
    x,
    grad_output,
    group=None,
) -> dict:
    """Returns output, grad_input, and every parameter's shard and its gradient summed over the
    data-parallel group (keys as harness.rank.programs.tensor_parallel's MLP)."""
    if group is not None:
        raise ValueError("a mesh spans the whole world")
    recording.mark("setup")  # phases for the audit (no-ops outside an audited world)
    for members in [*tensor_parallel_groups, *data_parallel_groups]:
        ctx.group(members)
    tp = ctx.group(next(g for g in tensor_parallel_groups if ctx.rank in g))
    dp = ctx.group(next(g for g in data_parallel_groups if ctx.rank in g))
    fc1 = _dense(ctx, dense["fc1_weight"], dense["fc1_bias"])
    fc2 = _dense(ctx, dense["fc2_weight"], dense["fc2_bias"])
    module = require(impl, "TensorParallelMLP").from_dense(fc1, fc2, group=tp)
    all_reduce = require(impl, "all_reduce")
    x = ctx.to_device(x).requires_grad_(True)
    recording.mark("forward")
    y = module(x)
    recording.mark("backward")
    y.backward(ctx.to_device(grad_output))
    recording.mark("data_parallel")
    result = _parameters(module, "mlp")
    for key, value in result.items():
        if key.startswith("grad_") and value is not None:
            summed = value.contiguous().clone()
            all_reduce(summed, op=ReduceOp.SUM, group=dp)
            result[key] = summed
    recording.mark("after")
    return ctx.to_cpu({"output": _local(y), "grad_input": x.grad, **result})
