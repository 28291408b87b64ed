"""clip_grad_norm_ takes the norm of this rank's shards only, never reduced: each rank clips by its own factor (pytorch#170862: FSDP2 returned a local norm; torchtitan#596: one pipeline stage's norm).
targets: test_the_norm_is_global_and_every_rank_clips_by_it
"""

import math

import torch

import parallelism_conformance.impls.grad_clipping as _bundled
from parallelism_conformance.impls import *


def clip_grad_norm_(module, max_norm, norm_type=2.0):
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    total = _bundled._partial(grads, float(norm_type))
    norm = total if math.isinf(norm_type) else total.pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.dtype))
    return norm
