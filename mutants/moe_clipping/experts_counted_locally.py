"""clip_grad_norm_ counts each member's experts on that member only, never reduced over the group: every member clips by its own, smaller norm (the pattern of torchtitan#596, where the local part was one pipeline stage).
targets: moe
"""

from mutants._swap import swapped
from parallelism_conformance.impls import *
from parallelism_conformance.impls import expert_parallel, grad_clipping


def _experts_as_replicated(module, sharded=grad_clipping._sharded_parameters):
    for group, parameters in sharded(module):
        if not any(
            isinstance(m, expert_parallel.ExpertParallelMoE) and any(p is q for q in m.experts.parameters())
            for m in module.modules()
            for p in parameters
        ):
            yield group, parameters


def clip_grad_norm_(module, max_norm, norm_type=2.0, pp_group=None, tied=None):
    with swapped(grad_clipping, _sharded_parameters=_experts_as_replicated):
        return grad_clipping.clip_grad_norm_(module, max_norm, norm_type, pp_group, tied)
