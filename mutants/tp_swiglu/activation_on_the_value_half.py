"""SiLU is applied to the second half of the fused projection (the value) instead of the first (the gate): silu(b) * a instead of silu(a) * b, a swapped [up | gate] convention.
targets: test_swiglu_with_fused_gate_and_up_equals_the_dense_mlp
"""

import torch.nn.functional as F

import parallelism_conformance.impls.transformer_layers as _bundled
from parallelism_conformance.impls import *


class TensorParallelSwiGLU(_bundled.TensorParallelSwiGLU):
    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(up) * gate)
