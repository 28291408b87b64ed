"""Known-bad parallelize functions (``--parallelize parallelize_examples/bad.py:NAME``): each a bug
teams reported, each must fail naming the step and the parameter (tests/test_parallelize.py)."""

from __future__ import annotations

from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from parallelism_conformance.parallelize_examples import good


class _RowwiseLeftPartial(RowwiseParallel):
    """RowwiseParallel whose output is handed on as each rank's partial product: the redistribution
    to Replicate (the all-reduce a row-parallel layer owes) is skipped. (``RowwiseParallel(output_layouts=
    Partial())``, the direct spelling, does not run in torch 2.13: DTensor refuses the 3-D input's
    linear, "would remove or reshape sharded dimension 2".)"""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()


def rowwise_output_left_partial(model, mesh):
    """good.TP_PLAN with the SwiGLU's down projection ``w2`` row-parallel but its output left
    ``Partial``: each tp rank adds its own partial product to the residual stream, never the sum.
    Wrong values from the first forward at tp >= 2, no error: the shapes all fit."""
    plan = {**good.TP_PLAN, "feed_forward.w2": _RowwiseLeftPartial()}
    for block in model.layers:
        parallelize_module(block, mesh["tp"], plan)
    return model


rowwise_output_left_partial.mesh_dims = ("tp",)


def replicas_not_averaged(model, mesh):
    """Data parallelism across dp_replicate with no gradient all-reduce: each replica steps on its own
    rows' gradient, and the replicas drift apart from the first step."""
    return model


replicas_not_averaged.mesh_dims = ("dp_replicate",)


def gradient_divided_twice(model, mesh):
    """FSDP2 on dp_shard with the gradient divided by the mesh size twice: FSDP's own average, and a
    divide factor of dp^2 set on top (the sum's division by dp applied again by hand)."""
    model = good.fsdp(model, mesh)
    n = mesh["dp_shard"].size()
    for module in [*model.layers, model]:
        module.set_gradient_divide_factor(float(n * n))
        if n > 1:
            module.set_force_sum_reduction_for_comms(True)  # gloo refuses PREMUL_SUM (adapters/torch_fsdp.py)
    return model


gradient_divided_twice.mesh_dims = ("dp_shard",)


def down_projection_left_replicated(model, mesh):
    """The SwiGLU's up projections ``w1`` and ``w3`` column-parallel, its down projection ``w2`` left
    out of the plan (a whole, replicated nn.Linear). Not wrong values but a crash at tp >= 2: w2 gets
    each rank's ffn / tp columns and expects ffn ("mat1 and mat2 shapes cannot be multiplied"); the
    rank's traceback is the failure, the example names the mesh."""
    plan = {name: style for name, style in good.TP_PLAN.items() if name != "feed_forward.w2"}
    for block in model.layers:
        parallelize_module(block, mesh["tp"], plan)
    return model


down_projection_left_replicated.mesh_dims = ("tp",)
