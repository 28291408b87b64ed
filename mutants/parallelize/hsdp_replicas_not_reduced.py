"""HSDP meant, FSDP2 applied on dp_shard alone while the batch is split over dp_replicate x dp_shard too: the gradients are reduce-scattered within each replica and never all-reduced across replicas, so the replicas drift apart.
targets: step_by_step and dp_replicate2
"""

from torch.distributed.fsdp import fully_shard


def parallelize(model, mesh):
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    return fully_shard(model, mesh=mesh["dp_shard"])


parallelize.mesh_dims = ("dp_replicate", "dp_shard")
