"""The expert-parallel oracle against the formula it encodes, token by token, and against itself
with the tokens dealt differently across ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import parallelism_conformance.reference.expert_parallel as ref


def layer(seed: int, experts: int, h: int, f: int):
    g = torch.Generator().manual_seed(seed)
    weights = [
        (
            torch.randn(f, h, generator=g, dtype=torch.float64),
            torch.randn(f, generator=g, dtype=torch.float64),
            torch.randn(h, f, generator=g, dtype=torch.float64),
            torch.randn(h, generator=g, dtype=torch.float64),
        )
        for _ in range(experts)
    ]
    return torch.randn(experts, h, generator=g, dtype=torch.float64), weights, g


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    experts=st.integers(1, 4),
    h=st.integers(1, 4),
    f=st.integers(1, 4),
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=3),
)
def test_each_token_goes_to_its_top_expert_scaled_by_its_gate(seed, experts, h, f, tokens):
    router, weights, g = layer(seed, experts, h, f)
    xs = [torch.randn(t, h, generator=g, dtype=torch.float64) for t in tokens]
    grads = [torch.randn(t, h, generator=g, dtype=torch.float64) for t in tokens]
    result = ref.moe(xs, router, weights, grads)
    for x, y in zip(xs, result["outputs"]):
        for row, out in zip(x, y):
            p = torch.softmax(row @ router.T, dim=-1)
            e = int(torch.argmax(p))
            w1, b1, w2, b2 = weights[e]
            torch.testing.assert_close(out, p[e] * (F.gelu(row @ w1.T + b1) @ w2.T + b2))
    # dealing the same tokens to one rank changes nothing but how the router gradient is split
    together = ref.moe([torch.cat(xs)], router, weights, [torch.cat(grads)])
    torch.testing.assert_close(torch.cat(result["outputs"]), together["outputs"][0])
    torch.testing.assert_close(torch.cat(result["grad_inputs"]), together["grad_inputs"][0])
    torch.testing.assert_close(sum(result["grad_router"]), together["grad_router"][0])
    for mine, theirs in zip(result["grad_experts"], together["grad_experts"]):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b)


def test_an_expert_no_token_chose_has_zero_gradients():
    router = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)  # positive tokens all choose expert 0
    weights = [tuple(torch.ones(s, dtype=torch.float64) for s in ((2, 1), (2,), (1, 2), (1,)))] * 2
    x = torch.tensor([[0.5], [2.0]], dtype=torch.float64)
    result = ref.moe([x], router, weights, [torch.ones_like(x)])
    assert all(bool((t == 0).all()) for t in result["grad_experts"][1])
    assert not all(bool((t == 0).all()) for t in result["grad_experts"][0])
