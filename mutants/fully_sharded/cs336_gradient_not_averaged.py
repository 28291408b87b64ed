"""A CS336 FSDP reduce-scatters each sharded gradient but never divides it by the world size.
targets: test_training_matches_one_process_and_memory_is_sharded
graded as: a CS336 submission
"""

import torch.distributed as dist

from mutants.fully_sharded._cs336 import fsdp, handout_functions


class FSDP(fsdp.FSDP):
    def reduce_scatter(self, param, full_grad):
        return super().reduce_scatter(param, full_grad) * dist.get_world_size()


get_fsdp, fsdp_on_after_backward, fsdp_gather_full_params = handout_functions(FSDP)
