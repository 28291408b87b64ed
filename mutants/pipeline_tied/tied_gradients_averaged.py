"""The copies' gradients are averaged instead of summed (an all-reduce with AVG, as data parallelism reduces): the tied weight's gradient is half the sum of its two uses.
targets: test_a_weight_tied_across_stages_gets_the_sum_of_both_uses_on_every_copy
"""

import parallelism_conformance.impls.tied_weights as _bundled
from parallelism_conformance.impls import *


def sync_tied_gradients(stages, tied, group=None):
    _bundled.sync_tied_gradients(stages, tied, group)
    holders = {_bundled.dist.get_rank(group)} & {stage % _bundled.dist.get_world_size(group) for stage, _ in tied}
    if holders:
        copies = []
        p, modules = _bundled.dist.get_world_size(group), _bundled._stage_modules(stages)
        for stage, name in tied:
            if stage % p == _bundled.dist.get_rank(group):
                parameter = modules[stage // p].get_parameter(name)
                if all(parameter is not seen for seen in copies):
                    copies.append(parameter)
        for parameter in copies:
            parameter.grad /= 2
