"""The oracle of the tensor-parallel attention and SwiGLU checked against torch's own fused kernels
and against itself across layouts: written out head by head, it must agree with
F.scaled_dot_product_attention(enable_gqa=True); the members' rows must cover the fused weight once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import parallelism_conformance.reference.transformer_layers as ref


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(1, 1, 3), (4, 2, 2), (6, 2, 1), (8, 4, 2)])
def test_attention_agrees_with_torchs_grouped_query_kernel(heads, kv_heads, d):
    g = torch.Generator().manual_seed(heads * 7 + kv_heads)
    batch, seq, hidden = 2, 5, 6
    w = torch.randn((heads + 2 * kv_heads) * d, hidden, generator=g, dtype=torch.float64)
    wo = torch.randn(hidden, heads * d, generator=g, dtype=torch.float64)
    x = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64)
    mine = ref.attention_forward(x, w, None, wo, None, num_heads=heads, num_kv_heads=kv_heads, layout="concatenated")
    q, k, v = F.linear(x, w).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = (t.reshape(batch, seq, -1, d).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).flatten(-2)
    torch.testing.assert_close(mine, F.linear(o, wo), rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", ref.QKV_LAYOUTS)
@pytest.mark.parametrize(("heads", "kv_heads", "n"), [(4, 2, 2), (6, 2, 2), (8, 4, 4), (3, 3, 3)])
def test_the_members_rows_cover_the_fused_weight_once_and_read_as_a_smaller_dense_layer(layout, heads, kv_heads, n):
    d = 2
    rows = [ref.qkv_rows(layout, heads, kv_heads, d, n, r) for r in range(n)]
    assert sorted(torch.cat(rows).tolist()) == list(range((heads + 2 * kv_heads) * d))
    # member r's rows, read in the layout for its own head counts, are the heads the split gives it
    q, k, v = ref._head_rows(layout, heads, kv_heads, d)
    for r, mine in enumerate(rows):
        local_q, local_k, _ = ref._head_rows(layout, heads // n, kv_heads // n, d)
        per_q, per_kv = heads // n, kv_heads // n
        assert torch.equal(mine[local_q.reshape(-1)], q[r * per_q : (r + 1) * per_q].reshape(-1))
        assert torch.equal(mine[local_k.reshape(-1)], k[r * per_kv : (r + 1) * per_kv].reshape(-1))
    assert torch.equal(ref.qkv_rows(layout, heads, kv_heads, d, 1, 0), torch.arange((heads + 2 * kv_heads) * d))


def test_a_grouped_checkpoint_is_the_concatenated_one_permuted():
    heads, kv_heads, d = 6, 2, 2
    g = torch.Generator().manual_seed(3)
    w = torch.randn((heads + 2 * kv_heads) * d, 5, generator=g, dtype=torch.float64)
    wo = torch.randn(5, heads * d, generator=g, dtype=torch.float64)
    x = torch.randn(2, 4, 5, generator=g, dtype=torch.float64)
    order = ref._fused("grouped", *ref._head_rows("concatenated", heads, kv_heads, d))
    a = ref.attention_forward(x, w, None, wo, None, num_heads=heads, num_kv_heads=kv_heads, layout="concatenated")
    b = ref.attention_forward(x, w[order], None, wo, None, num_heads=heads, num_kv_heads=kv_heads, layout="grouped")
    # not bitwise: a GEMM may round an output column by its position in the matrix (a vectorised
    # block or its tail); permuting the rows of w moved some, 2.7e-15 apart on an AVX-512 EPYC. A
    # wrong permutation pairs other heads and differs by O(1).
    torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_swiglu_gates_with_the_first_half():
    g = torch.Generator().manual_seed(4)
    w, wd = torch.randn(6, 3, generator=g, dtype=torch.float64), torch.randn(3, 3, generator=g, dtype=torch.float64)
    x = torch.randn(2, 3, generator=g, dtype=torch.float64)
    a, b = x @ w[:3].T, x @ w[3:].T
    torch.testing.assert_close(ref.swiglu_forward(x, w, None, wd, None), (F.silu(a) * b) @ wd.T, rtol=0, atol=1e-13)
    assert ref.gate_up_rows(4, 2, 1).tolist() == [2, 3, 6, 7]


def test_heads_that_do_not_split_are_refused_with_the_dimension_named():
    with pytest.raises(ValueError, match=r"num_kv_heads = 3 .* group size 2"):
        ref.check_heads(6, 3, 24, 2)
    with pytest.raises(ValueError, match="num_heads = 5"):
        ref.check_heads(5, 2, 18, 1)
