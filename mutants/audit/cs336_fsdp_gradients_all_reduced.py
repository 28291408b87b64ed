"""A CS336 FSDP all-reduces each sharded weight's full gradient and keeps its own rows, where the handout asks for a reduce-scatter: right values, twice the traffic.
targets: test_fully_sharded_step
graded as: a CS336 submission

The handout's tests compare values only (6 public submissions all-reduce).
"""

import torch.distributed as dist

from mutants.fully_sharded._cs336 import fsdp, handout_functions


class FSDP(fsdp.FSDP):
    def reduce_scatter(self, param, full_grad):
        shard = self.shards[id(param)]
        padded = full_grad.new_zeros((shard.per_rank * self.world_size, *full_grad.shape[1:]))
        padded[: shard.rows] = full_grad
        dist.all_reduce(padded)
        mine = padded[self.rank * shard.per_rank : (self.rank + 1) * shard.per_rank]
        return (mine / self.world_size).to(param.dtype)


get_fsdp, fsdp_on_after_backward, fsdp_gather_full_params = handout_functions(FSDP)
