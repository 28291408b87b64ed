"""Every (stage, name) entry of ``tied`` is added as a copy, also when two entries are one Parameter on this rank (p = 1: the first and the last stage on one rank, whose backward already summed both uses into it), so the weight's gradient counts both uses twice.
targets: test_a_weight_tied_across_stages_gets_the_sum_of_both_uses_on_every_copy
"""

import torch.distributed as dist

import parallelism_conformance.impls.tied_weights as _bundled
from parallelism_conformance.impls import *


def sync_tied_gradients(stages, tied, group=None):
    p, me = dist.get_world_size(group), dist.get_rank(group)
    modules = _bundled._stage_modules(stages)
    mine = [modules[stage // p].get_parameter(name) for stage, name in tied if stage % p == me]
    if len({id(parameter) for parameter in mine}) == len(mine) or not mine:
        return _bundled.sync_tied_gradients(stages, tied, group)
    total = sum((parameter.grad for parameter in mine[1:]), mine[0].grad.detach().clone())
    mine[0].grad.copy_(total)
    return None
