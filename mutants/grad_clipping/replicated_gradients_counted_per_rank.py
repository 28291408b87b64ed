"""clip_grad_norm_ all-reduces every parameter's partial norm, replicated ones too: a data-parallel gradient, whole on every rank, is counted n times (ROCm/TransformerEngine#715: replicated weights counted tp-size times, the norm 1.52x at TP=8).
targets: test_the_norm_is_global_and_every_rank_clips_by_it and data_parallel

Right on fully sharded modules, where every gradient is a shard; only the data-parallel layout shows it.
"""
import math

import torch
import torch.distributed as dist

import impls.grad_clipping as _bundled
from impls import *
from impls import collectives


def clip_grad_norm_(module, max_norm, norm_type=2.0):
    norm_type = float(norm_type)
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    part = _bundled._partial(grads, norm_type).reshape(1)
    collectives.all_reduce(part, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    norm = part[0] if math.isinf(norm_type) else part[0].pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.dtype))
    return norm
