"""Plans whose values are right but whose ranks hold more than their placements claim
(``--parallelize parallelize_examples/costly.py:NAME``): the test passes, reading *costs more* with
the ratio and the tensors above their claim (conformance/parallelize_memory.py), and fails only under
``--require-bounds yes``."""

from __future__ import annotations

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
