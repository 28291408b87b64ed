"""Under sequence parallelism the LayerNorm's gradients are averaged over the group instead of summed (the data-parallel habit): each shard's partial gradient is divided by n, the whole gradient 1/n of the truth.
targets: test_a_layernorm_before_the_mlp_keeps_whole_gradients
"""

import torch
import torch.nn.functional as F

import parallelism_conformance.impls.tensor_parallel as _bundled
from parallelism_conformance.impls import *


class _AveragedGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _bundled._all_reduce(grad, ctx.group) / _bundled._size(ctx.group), None


class TensorParallelMLP(_bundled.TensorParallelMLP):
    def _normed(self, x):
        norm = self.norm
        if norm is None or not self.sequence_parallel:
            return x if norm is None else norm(x)
        weight, bias = (_AveragedGradient.apply(p, self.group) for p in (norm.weight, norm.bias))
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)
