"""A CS336 FSDP gives each rank rows // n rows of a weight: when n does not divide the first dimension the last rows belong to no rank and never train.
targets: test_training_matches_one_process_and_memory_is_sharded
graded as: a CS336 submission

The handout's shapes are all even at 2 ranks (4 public submissions drop rows this way).
"""

import torch
import torch.distributed as dist

from mutants.fully_sharded._cs336 import WithShards, fsdp, handout_functions


class _FloorShard(fsdp._Shard):
    def __init__(self, param, world_size, rank):
        self.rows, self.world_size = param.shape[0], world_size
        self.per_rank = param.shape[0] // world_size
        rows = param.detach()[rank * self.per_rank : (rank + 1) * self.per_rank]
        self.param = torch.nn.Parameter(rows.clone())


class FSDP(WithShards):
    shard_class = _FloorShard

    def gather(self, param, dtype=None):  # the dropped rows come back as zeros
        shard = self.shards[id(param)]
        local = param.detach().to(dtype or param.dtype)
        out = torch.zeros((shard.rows, *local.shape[1:]), dtype=local.dtype, device=local.device)
        if shard.per_rank:
            kept = torch.empty((shard.per_rank * self.world_size, *local.shape[1:]), dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(kept, local.contiguous())
            out[: len(kept)] = kept
        return out

    def reduce_scatter(self, param, full_grad):
        shard = self.shards[id(param)]
        out = full_grad.new_zeros((shard.per_rank, *full_grad.shape[1:]))
        if shard.per_rank:
            dist.reduce_scatter_tensor(out, full_grad[: shard.per_rank * self.world_size].contiguous())
        return (out / self.world_size).to(param.dtype)


get_fsdp, fsdp_on_after_backward, fsdp_gather_full_params = handout_functions(FSDP)
