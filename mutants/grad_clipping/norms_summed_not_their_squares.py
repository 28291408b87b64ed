"""clip_grad_norm_ all-reduces each rank's 2-norm and adds the norms, where the squares must be added before the root: sum_r ||g_r|| instead of sqrt(sum_r ||g_r||^2).
targets: test_the_norm_is_global_and_every_rank_clips_by_it
"""

import math

import torch
import torch.distributed as dist

import parallelism_conformance.impls.grad_clipping as _bundled
from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives


def clip_grad_norm_(module, max_norm, norm_type=2.0):
    norm_type = float(norm_type)
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    local = _bundled._partial(grads, norm_type)
    local = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
    part = local.reshape(1)
    collectives.all_reduce(part, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    norm = part[0]
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.dtype))
    return norm
