"""clip_grad_norm_ all-gathers every sharded gradient and takes the norm of the full tensors: the right norm, for n times a shard's bytes instead of one scalar.
targets: test_clipping_reduces_scalars_only and fully_sharded
"""

import math

import torch

import parallelism_conformance.impls.grad_clipping as _bundled
from parallelism_conformance.impls import *
from parallelism_conformance.impls import collectives


def clip_grad_norm_(module, max_norm, norm_type=2.0):
    norm_type = float(norm_type)
    full = []
    seen = set()
    for group, pieces in _bundled._sharded_parameters(module):
        for piece in pieces:
            if id(piece) in seen or piece.grad is None:
                continue
            seen.add(id(piece))
            n = torch.distributed.get_world_size(group)
            gathered = piece.grad.new_empty(piece.grad.numel() * n)
            collectives.all_gather_into_tensor(gathered, piece.grad.contiguous().reshape(-1), group=group)
            full.append(gathered)
    full += [p.grad for p in module.parameters() if id(p) not in seen and p.grad is not None]
    total = _bundled._partial(full, norm_type)
    norm = total if math.isinf(norm_type) else total.pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(coefficient.to(p.grad.dtype))
    return norm
