"""clip_grad_norm_ with norm_type=inf raises the largest |g| to the power 1/q as for a p-norm, and (max |g|)^(1/inf) is 1.0 whatever the gradients: it returns 1.0 and clips by it (torchrec#3199: the infinity norm of FSDP2's clipping was always 1.0).
targets: test_the_norm_is_global_and_every_rank_clips_by_it
"""

import math

import torch

import parallelism_conformance.impls.grad_clipping as _bundled
from parallelism_conformance.impls import *


def clip_grad_norm_(module, max_norm, norm_type=2.0, pp_group=None, tied=None):
    if not math.isinf(float(norm_type)):
        return _bundled.clip_grad_norm_(module, max_norm, norm_type, pp_group, tied)
    _bundled.clip_grad_norm_(module, math.inf, norm_type, pp_group, tied)  # the reductions, no clipping
    norm = torch.ones((), dtype=torch.float64)  # the maximum ** (1 / inf)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    stages = module if isinstance(module, (list, tuple)) else [module]
    with torch.no_grad():
        for p in {id(p): p for stage in stages for p in stage.parameters()}.values():
            if p.grad is not None:
                p.grad.mul_(coefficient.to(p.grad.dtype))
    return norm
