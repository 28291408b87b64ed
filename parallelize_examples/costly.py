"""Plans whose values are right but whose ranks hold more than their placements claim
(``--parallelize parallelize_examples/costly.py:NAME``): the test passes, reading *costs more* with
the ratio and the tensors above their claim (conformance/parallelize_memory.py), and fails only under
``--require-bounds yes``."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard


def fsdp_keeping_a_full_copy(model, mesh):
    """good.py's ``fsdp`` (FSDP2 on dp_shard, each block a unit, then the root), with a whole copy of
    the head's weight kept as a buffer on every rank, as a plan does that keeps an unsharded master
    or EMA copy of a weight it shards: the parameters, gradients and optimizer state are sharded as
    claimed, the copy is held beside them and claimed by nothing (the dense model has no buffer)."""
    model.register_buffer("output_weight_copy", model.output.weight.detach().clone())
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    return fully_shard(model, mesh=mesh["dp_shard"])


fsdp_keeping_a_full_copy.mesh_dims = ("dp_shard",)


def fsdp_logging_full_weight_norms(model, mesh):
    """good.py's ``fsdp``, with what a team adds to watch training: before each forward, every
    parameter's norm, taken on the whole weight (``full_tensor()``, an all-gather of each sharded
    parameter along dp_shard) and kept for a logger. The values are right; the gathers are beyond
    what FSDP's placements imply (conformance/parallelize_traffic.py): the traffic test reads *costs
    more* with the ratio along dp_shard, and fails only under ``--require-bounds yes``."""
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    model = fully_shard(model, mesh=mesh["dp_shard"])

    def log_norms(module, args):
        with torch.no_grad():
            module.logged_norms = [float(p.full_tensor().norm()) for p in module.parameters() if hasattr(p, "full_tensor")]

    model.register_forward_pre_hook(log_norms, prepend=True)  # before FSDP's own: the parameters are still sharded
    return model


fsdp_logging_full_weight_norms.mesh_dims = ("dp_shard",)
