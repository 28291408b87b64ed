"""clip_grad_norm_ walks the modules and counts each module's own parameters, so a weight tied between the embedding and the head is counted twice (Megatron-LM#7227: the norm sqrt(2)x, over-clipped).
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
    grads = [p.grad for m in module.modules() for p in m.parameters(recurse=False) if p.grad is not None]
    part = _bundled._partial(grads, norm_type).reshape(1)
    collectives.all_reduce(part, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    norm = part[0] if math.isinf(norm_type) else part[0].pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(coefficient.to(p.grad.dtype))
    return norm
