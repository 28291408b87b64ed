"""A CS336 FSDP writes each reduce-scattered gradient into .grad instead of returning it to autograd: the second backward of a step replaces the first's (gradient accumulation lost).
targets: test_training_matches_one_process_and_memory_is_sharded
graded as: a CS336 submission

The handout's loop has one backward per step, so its tests never see it (2 public submissions).
"""

from mutants.fully_sharded._cs336 import fsdp, handout_functions


class FSDP(fsdp.FSDP):
    def gradient_of(self, param, full_grad):
        grad = super().gradient_of(param, full_grad)
        if grad is not None:
            param.grad = grad
        return None


get_fsdp, fsdp_on_after_backward, fsdp_gather_full_params = handout_functions(FSDP)
