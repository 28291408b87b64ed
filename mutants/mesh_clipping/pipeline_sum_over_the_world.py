"""clip_grad_norm_ adds the stages' sums over the whole world instead of the pipeline group it was given: right when the pipeline spans the world, on a mesh every replica and tensor-parallel rank adds its copy too, the norm sqrt(dp tp) times too large for the 2-norm.
targets: clipping
"""

import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls import grad_clipping


def clip_grad_norm_(module, max_norm, norm_type=2.0, pp_group=None, tied=None):
    return grad_clipping.clip_grad_norm_(module, max_norm, norm_type, dist.group.WORLD if pp_group is not None else None, tied)
