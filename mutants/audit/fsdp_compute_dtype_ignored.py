"""fully_shard accepts compute_dtype and ignores it: everything stays float32, so the gathers carry twice the bytes the compute dtype promises.
targets: test_fully_sharded_step_gathers_in_the_compute_dtype

On the exact examples of the value test float32 gives the same numbers; only the traffic shows it.
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import fully_sharded as _bundled

_fully_shard = _bundled.fully_shard


def fully_shard(module, group=None, reshard_after_forward=True, compute_dtype=None):
    return _fully_shard(module, group=group, reshard_after_forward=reshard_after_forward)
