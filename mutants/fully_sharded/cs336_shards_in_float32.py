"""A CS336 FSDP builds its shards as float32 whatever the model's dtype: a float64 model trains in float32, silently.
targets: test_training_matches_one_process_and_memory_is_sharded
graded as: a CS336 submission

The handout trains float32 models only (at least 8 public submissions crash or cast on float64).
"""

import torch

from mutants.fully_sharded._cs336 import WithShards, fsdp, handout_functions


class _Float32Shard(fsdp._Shard):
    def __init__(self, param, world_size, rank):
        super().__init__(param, world_size, rank)
        self.param = torch.nn.Parameter(self.param.detach().to(torch.float32))


class FSDP(WithShards):
    shard_class = _Float32Shard


get_fsdp, fsdp_on_after_backward, fsdp_gather_full_params = handout_functions(FSDP)
