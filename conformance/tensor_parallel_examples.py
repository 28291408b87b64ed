"""The examples the tensor parallelism tests draw (conformance/test_tensor_parallel.py, and the tests
of tp_dropout, tp_compute_dtype and grad_clipping that reuse them): ``Example``, one layer or MLP on
a layout with its widths, leading dims, bias, dtype and seed, which builds its dense tensors, and the
``examples`` strategy that draws one with the width a layer splits a multiple of the group size."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from parallelism_conformance.conformance.examples import Layout, dense_layers, layouts

DTYPES = (torch.float32, torch.float64)
NORM_EPS = 1e-5  # nn.LayerNorm's default


@dataclass(frozen=True)
class Example:
    layout: Layout
    dtype: torch.dtype
    in_features: int
    out_features: int
    leading: tuple[int, ...]  # extra leading dims of the input (for the MLP with sequence parallelism, the last is the sequence)
    bias: bool
    seed: int
    ffn: int = 0  # the MLP's hidden width (in_features = out_features = h)
    norm: bool = False  # a LayerNorm before the MLP (capability tp_norm)

    @property
    def n(self) -> int:
        return self.layout.size

    def __str__(self) -> str:
        widths = f"h={self.in_features}, ffn={self.ffn}" if self.ffn else f"in={self.in_features}, out={self.out_features}"
        return (
            f"{self.layout}, {str(self.dtype).removeprefix('torch.')}, {widths}, input leading dims {self.leading}, "
            f"bias={self.bias}, seed={self.seed}" + (f", LayerNorm(eps={NORM_EPS:g}) before fc1" if self.norm else "")
        )

    def tensors(self) -> dict:
        """The dense weights (nn.Linear's init: U(-1/sqrt(in), 1/sqrt(in))), the input x and the
        upstream gradient g = dL/dy, all full size, built from the seed."""
        layers = [(self.in_features, self.ffn), (self.ffn, self.in_features)] if self.ffn else [(self.in_features, self.out_features)]
        out = self.in_features if self.ffn else self.out_features
        tensors = dense_layers(self.seed, self.dtype, layers, self.bias, (*self.leading, self.in_features), (*self.leading, out))
        if self.norm:  # from a generator of its own: the other tensors stay those of the same seed
            g = torch.Generator().manual_seed(self.seed + 7919)
            weight = 1 + 0.25 * torch.randn(self.in_features, generator=g, dtype=torch.float64)
            bias = 0.1 * torch.randn(self.in_features, generator=g, dtype=torch.float64)
            tensors["norm"] = (weight.to(self.dtype), bias.to(self.dtype), NORM_EPS)
        return tensors


@st.composite
def examples(draw, max_world_size: int, split: str, min_size: int = 1) -> Example:
    """``split``: which width is a multiple of n: "out" (column), "in" (row), "ffn" (MLP), "sequence"
    (the MLP with sequence parallelism: the sequence too)."""
    layout = draw(layouts(max_world_size, min_size), label="layout")
    n = layout.size
    multiple = st.integers(1, 4).map(lambda k: k * n)
    free = st.integers(1, 8)
    leading = tuple(draw(st.lists(st.integers(1, 3), max_size=2), label="leading dims"))
    if split == "sequence":
        leading = (*leading[:1], draw(st.integers(1, 3), label="sequence per rank") * n)
    ffn = draw(multiple) if split in ("ffn", "sequence") else 0
    return Example(
        layout=layout,
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        in_features=draw(multiple if split == "in" else free),
        out_features=draw(multiple if split == "out" else free),
        leading=leading,
        bias=draw(st.booleans(), label="bias"),
        seed=draw(st.integers(0, 2**16), label="seed"),
        ffn=ffn,
    )
