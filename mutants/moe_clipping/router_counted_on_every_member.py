"""clip_grad_norm_ sums the replicated router's part over the group with the experts', so the router counts once per member: the norm too large, every member over-clipped (ROCm/TransformerEngine#715: replicated weights counted tp-size times, the norm 1.52x at TP = 8).
targets: moe
"""

from mutants._swap import swapped
from parallelism_conformance.impls import *
from parallelism_conformance.impls import expert_parallel, grad_clipping


def _router_with_the_experts(module, sharded=grad_clipping._sharded_parameters):
    for group, parameters in sharded(module):
        owner = next(
            (
                m
                for m in module.modules()
                if isinstance(m, expert_parallel.ExpertParallelMoE) and any(p is q for q in m.experts.parameters() for p in parameters)
            ),
            None,
        )
        yield group, parameters + ([owner.router.weight] if owner is not None else [])


def clip_grad_norm_(module, max_norm, norm_type=2.0, pp_group=None, tied=None):
    with swapped(grad_clipping, _sharded_parameters=_router_with_the_experts):
        return grad_clipping.clip_grad_norm_(module, max_norm, norm_type, pp_group, tied)
