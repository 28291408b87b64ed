"""fully_shard ignores gradient_divide_factor: the reduce-scatter still divides by n after the loss was divided by the global token count (torchtitan#2323's double division, on FSDP).
targets: test_fully_sharded_gradients_are_the_mean_over_every_valid_token
"""

import parallelism_conformance.impls.fully_sharded as _bundled
from parallelism_conformance.impls import *


def fully_shard(module, group=None, reshard_after_forward=True, compute_dtype=None, gradient_divide_factor=None):
    return _bundled.fully_shard(module, group, reshard_after_forward, compute_dtype)
