"""The examples of context-parallel attention (conformance/test_context_parallel.py and its audit):
the example and the Hypothesis strategy that draws it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from parallelism_conformance.conformance.examples import Layout, layouts


@dataclass(frozen=True)
class AttentionExample:
    """One context-parallel attention example (conformance/test_context_parallel.py, the audit)."""

    layout: Layout
    heads: int
    width: int
    seq_len: int
    causal: bool
    dtype: torch.dtype
    scale: float
    seed: int

    def tensors(self) -> dict:
        g = torch.Generator().manual_seed(self.seed)
        shape = (self.heads, self.seq_len, self.width)
        q, k, v, grad = (torch.randn(shape, generator=g, dtype=torch.float64) * s for s in (self.scale, self.scale, 1.0, 1.0))
        return {name: t.to(self.dtype) for name, t in zip(("q", "k", "v", "grad_output"), (q, k, v, grad))}

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.layout}, heads={self.heads}, width={self.width}, seq_len={self.seq_len}, causal={self.causal}, "
            f"dtype={dtype}, scale={self.scale:g}, seed={self.seed}"
        )


@st.composite
def attention_examples(draw, max_world_size: int, min_size: int = 1) -> AttentionExample:
    layout = draw(layouts(max_world_size, min_size), label="layout")
    n = layout.size
    return AttentionExample(
        layout,
        draw(st.integers(1, 3), label="heads"),
        draw(st.integers(1, 8), label="width"),
        draw(st.integers(2 * n, 6 * n + 5), label="seq_len"),
        draw(st.booleans(), label="causal"),
        draw(st.sampled_from([torch.float64, torch.float32]), label="dtype"),
        draw(st.sampled_from([0.5, 3.0]), label="scale"),
        draw(st.integers(0, 2**16), label="seed"),
    )
