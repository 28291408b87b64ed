"""The last stage sends its copy's gradient to the first stage, which adds it, but never receives the first stage's: the embedding's gradient is right and the head's copy keeps its own use only, so the copies drift apart after the first step.
targets: test_a_weight_tied_across_stages_gets_the_sum_of_both_uses_on_every_copy
"""

import torch
import torch.distributed as dist

import parallelism_conformance.impls.tied_weights as _bundled
from parallelism_conformance.impls import *


def sync_tied_gradients(stages, tied, group=None):
    p, me = dist.get_world_size(group), dist.get_rank(group)
    first, last = tied[0][0] % p, tied[-1][0] % p
    if first == last:
        return _bundled.sync_tied_gradients(stages, tied, group)
    modules = _bundled._stage_modules(stages)
    if me == last:
        stage, name = tied[-1]
        dist.send(modules[stage // p].get_parameter(name).grad.contiguous(), _bundled._global(group, first), group=group)
    elif me == first:
        stage, name = tied[0]
        parameter = modules[stage // p].get_parameter(name)
        other = torch.empty_like(parameter.grad)
        dist.recv(other, _bundled._global(group, last), group=group)
        parameter.grad += other
    return None
