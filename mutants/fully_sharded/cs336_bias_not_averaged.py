"""A CS336 FSDP all-reduces the gradient of each replicated parameter (a bias, a norm's weight) but never divides it by the world size.
targets: test_training_matches_one_process_and_memory_is_sharded
graded as: a CS336 submission

The handout's toy model's replicated parameters are RMSNorm weights, whose gradient its test never compares.
"""

import torch.distributed as dist

from mutants.fully_sharded._cs336 import fsdp, handout_functions


class FSDP(fsdp.FSDP):
    def _averaged(self, grad):
        return super()._averaged(grad) * dist.get_world_size()


get_fsdp, fsdp_on_after_backward, fsdp_gather_full_params = handout_functions(FSDP)
