"""A CS336 FSDP with compute_dtype all-gathers its float32 shards and casts the full weight afterwards: right values, twice the gather traffic.
targets: test_fully_sharded_step_gathers_in_the_compute_dtype
graded as: a CS336 submission

The handout says "cast before communication"; its tests compare values only (9 public submissions cast after).
"""

from mutants.fully_sharded._cs336 import fsdp, handout_functions


class FSDP(fsdp.FSDP):
    def gather(self, param, dtype=None):
        full = super().gather(param)
        return full.to(dtype) if dtype is not None else full


get_fsdp, fsdp_on_after_backward, fsdp_gather_full_params = handout_functions(FSDP)
