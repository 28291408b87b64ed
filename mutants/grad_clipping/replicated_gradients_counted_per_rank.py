"""clip_grad_norm_ all-reduces every parameter's partial norm over the group, replicated ones too: a data-parallel gradient, or a row-parallel layer's whole bias, is counted once per rank (ROCm/TransformerEngine#715: replicated weights counted tp-size times, the norm 1.52x at TP=8).
targets: (test_the_norm_is_global_and_every_rank_clips_by_it and data_parallel) or test_a_tensor_parallel_mlp_counts_its_replicated_bias_once

Right on fully sharded modules, where every gradient is a shard; the data-parallel and tensor-parallel layouts show it.
"""

import math

import torch
import torch.distributed as dist

import parallelism_conformance.impls.grad_clipping as _bundled
from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives


def clip_grad_norm_(module, max_norm, norm_type=2.0):
    norm_type = float(norm_type)
    group = next((g for g, _ in _bundled._sharded_parameters(module)), None)
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    part = _bundled._partial(grads, norm_type).reshape(1)
    collectives.all_reduce(part, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
    norm = part[0] if math.isinf(norm_type) else part[0].pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.dtype))
    return norm
