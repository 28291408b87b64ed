"""A CS336 FSDP with compute_dtype keeps its shards (the masters) in the compute dtype: the optimizer updates float16 or bfloat16 weights.
targets: test_compute_dtype_computes_low_and_keeps_float32_masters
graded as: a CS336 submission

The handout: "master weights and the update in fp32"; its correctness test allows 1e-4 and its gradient test checks only that .grad matches the parameter's dtype.
"""

from mutants.fully_sharded._cs336 import WithShards, fsdp, handout_functions


class FSDP(WithShards):
    def __init__(self, module, compute_dtype=None):
        super().__init__(module, compute_dtype)
        if compute_dtype is not None:
            for shard in self.shards.values():
                shard.param.data = shard.param.data.to(compute_dtype)


get_fsdp, fsdp_on_after_backward, fsdp_gather_full_params = handout_functions(FSDP)
