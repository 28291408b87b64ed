"""A CS336 FSDP saves each linear layer's gathered weight for its backward instead of gathering it again: right values and less traffic, but every full weight alive from forward to backward.
targets: test_fully_sharded_step and relu_lm and zero3
graded as: a CS336 submission

The handout: "all-gather before forward and again in backward", "free gathered weights after use"; its tests compare values only (8 public submissions keep them).
"""

import torch

from mutants.fully_sharded._cs336 import fsdp, handout_functions


class _KeptLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, owner):
        dtype = owner.compute_dtype
        full = owner.gather_for_forward(weight, dtype)
        ctx.save_for_backward(x, full)
        ctx.owner, ctx.weight = owner, weight
        return (x.to(dtype) if dtype else x) @ full.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, full = ctx.saved_tensors
        grad_x = (grad_out @ full).to(x.dtype)
        x = x.to(full.dtype)
        grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, ctx.owner.gradient_of(ctx.weight, grad_w), None


class FSDP(fsdp.FSDP):
    def __init__(self, module, compute_dtype=None):
        original = fsdp._GatheredLinear
        fsdp._GatheredLinear = _KeptLinear
        try:
            super().__init__(module, compute_dtype)
        finally:
            fsdp._GatheredLinear = original


get_fsdp, fsdp_on_after_backward, fsdp_gather_full_params = handout_functions(FSDP)
