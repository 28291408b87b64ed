"""The LayerNorm's gradients are all-reduced over the group whatever the layout: without sequence parallelism every rank already holds the whole gradient, which becomes n times it (the sequence-parallel parameters' all-reduce applied to a replicated input).
targets: test_a_layernorm_before_the_mlp_keeps_whole_gradients
"""

import torch.nn.functional as F

import parallelism_conformance.impls.tensor_parallel as _bundled
from parallelism_conformance.impls import *


class TensorParallelMLP(_bundled.TensorParallelMLP):
    def _normed(self, x):
        norm = self.norm
        if norm is None:
            return x
        weight = _bundled.copy_to_parallel_region(norm.weight, self.group)
        bias = _bundled.copy_to_parallel_region(norm.bias, self.group)
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)
