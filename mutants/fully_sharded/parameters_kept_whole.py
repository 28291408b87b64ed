"""fully_shard keeps every parameter whole and all-reduces gradients, as DDP does: right values, nothing sharded.
targets: test_training_matches_one_process_and_memory_is_sharded

Each rank holds all parameters, gradients and optimizer state: the memory check (at most 1/n of one
process plus one unit) fails.
"""

import torch
import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls.collectives import all_reduce


def fully_shard(module, group=None):
    for parameter in module.parameters(recurse=False):
        if parameter.requires_grad and not getattr(parameter, "_kept_whole", False):
            parameter._kept_whole = True
            parameter.register_post_accumulate_grad_hook(lambda p: all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group))
    for child in module.children():
        if not any(getattr(p, "_kept_whole", False) for p in child.parameters()):
            fully_shard(child, group)
    return module


def full_parameters(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


_ = torch
