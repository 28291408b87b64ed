"""A CS336 FSDP shards each layer's weight on its own: a weight two layers share (a tied embedding and head) becomes two shards that train apart.
targets: test_training_matches_one_process_and_memory_is_sharded
graded as: a CS336 submission

The handout's toy model ties nothing (9 public submissions shard a tied weight twice or leave it unsynchronised).
"""

from mutants.fully_sharded._cs336 import fsdp, handout_functions


class FSDP(fsdp.FSDP):
    def __init__(self, module, compute_dtype=None):
        for layer in module.modules():  # every layer its own copy of the weight before sharding
            if isinstance(layer, (fsdp.Linear, fsdp.Embedding)):
                layer.weight = type(layer.weight)(layer.weight.detach().clone(), layer.weight.requires_grad)
        super().__init__(module, compute_dtype)


get_fsdp, fsdp_on_after_backward, fsdp_gather_full_params = handout_functions(FSDP)
