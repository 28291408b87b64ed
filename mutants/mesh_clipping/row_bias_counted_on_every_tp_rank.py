"""clip_grad_norm_ sums the row-parallel layer's bias, whole on every tensor-parallel rank, over the tensor-parallel group with the sharded weights: the bias counts tp times (ROCm/TransformerEngine#715: replicated weights counted tp-size times, the norm 1.52x at TP = 8).
targets: clipping
"""

from mutants._swap import swapped
from parallelism_conformance.impls import *
from parallelism_conformance.impls import grad_clipping, tensor_parallel


def _bias_with_the_shards(module, sharded=grad_clipping._sharded_parameters):
    for group, parameters in sharded(module):
        extra = [
            m.bias
            for m in module.modules()
            if isinstance(m, tensor_parallel.RowParallelLinear) and m.bias is not None and any(p is m.weight for p in parameters)
        ]
        yield group, parameters + extra


def clip_grad_norm_(module, max_norm, norm_type=2.0, pp_group=None, tied=None):
    with swapped(grad_clipping, _sharded_parameters=_bias_with_the_shards):
        return grad_clipping.clip_grad_norm_(module, max_norm, norm_type, pp_group, tied)
