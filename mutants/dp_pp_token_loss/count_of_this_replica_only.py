"""global_token_count returns this rank's own count when given a group that is not the world (as if a subgroup needed no reduction), so each pipeline's last stage divides by its own replica's valid rows: the gradients summed over the data-parallel group are up to dp times the global mean (NVIDIA-NeMo/Automodel#3830), with a normal-looking loss.
targets: test_pipelines_over_data_parallel_replicas_normalise_by_the_global_count
"""

import torch.distributed as dist

import parallelism_conformance.impls.token_loss as _bundled
from parallelism_conformance.impls import *


def global_token_count(local_count, group=None):
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        return int(local_count)
    return _bundled.global_token_count(local_count, group)
