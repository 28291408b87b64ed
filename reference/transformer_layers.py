"""Single-process truth for the tensor-parallel layers of a transformer block: causal self-attention
with a fused QKV projection and grouped-query attention, and a SwiGLU MLP with a fused gate/up
projection; which rows of each fused dense weight a rank of the group keeps; and the bound a
parallel result is checked within.

Attention (Vaswani et al. 2017; grouped-query attention, Ainslie et al. 2023): x [B, S, h],
qkv = x W_qkv^T + b_qkv of width (H + 2 H_kv) d, split into H query heads and H_kv key and value
heads of width d; query head i attends with key/value head i // G, G = H / H_kv;

    o_i = softmax(q_i k_{i//G}^T / sqrt(d) + M) v_{i//G},  M[p, t] = -inf for t > p (causal),

the heads' outputs concatenated head by head, [B, S, H d], then y = o W_out^T + b_out.

The fused rows come in one of two layouts (``QKV_LAYOUTS``):

* ``concatenated``: [Q | K | V], the H query heads' rows (d each, head by head), then the H_kv key
  heads', then the value heads' (a plain concatenation of three projections, as most checkpoints
  store a fused qkv_proj);
* ``grouped``: Megatron-LM's, group by group: for each key/value head g, the G query heads
  g G .. g G + G - 1, then key head g, then value head g.

Tensor parallelism splits by head (Megatron-LM, Shoeybi et al. 2019, section 3): rank r of n keeps
query heads [r H/n, (r + 1) H/n) and key/value heads [r H_kv/n, (r + 1) H_kv/n) (n must divide
H_kv: each rank then holds whole groups), its rows of W_qkv and b_qkv laid out in the same layout
for its own head counts, and columns [r H d/n, (r + 1) H d/n) of W_out with the whole b_out. In the
grouped layout that is a contiguous chunk of rows; in the concatenated one it is three pieces, and a
plain contiguous split of the fused rows hands a rank the wrong mix of heads
(NVIDIA-NeMo/Automodel#1324).

SwiGLU (Shazeer 2020): gate_up = x W_gu^T + b_gu of width 2f, its first f columns the gate a and
the next f the value b; y = (silu(a) * b) W_down^T + b_down. Rank r keeps rows [r f/n, (r + 1) f/n)
of the gate's and of the value's, in that order ([gate_r | up_r]), and columns r of W_down.

Every function computes in float64 with plain autograd. Never imports torch.distributed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

QKV_LAYOUTS = ("concatenated", "grouped")
# The bound of every check, relative: RELATIVE * (1 + |expected|), elementwise. Every result is at
# most ten nested sums of at most K <= 96 terms (h, (H + 2 H_kv) d <= 48, S <= 8, the rows B S <= 16
# summed into a weight gradient), each erring by gamma_K = K u times the sum of its terms' absolute
# values (Higham, 2nd ed., sec. 3.1), and exp/softmax add a few u; with the drawn scales (N(0, 1)
# inputs and upstream gradients, U(+-1/sqrt(fan_in)) weights) those sums stay below 10^3, so in
# float64 (u = 2^-53) the error is below 10 * 96 * 1.1e-16 * 10^3 ~ 1.1e-10, ninety times under
# RELATIVE. What the checks are for (a head paired with another's keys, a gate with the wrong value
# rows, a bias in the wrong place, attention over a sequence shard) moves results by O(0.01) or more.
RELATIVE = 1e-8


def check_heads(num_heads: int, num_kv_heads: int, qkv_rows: int, n: int) -> int:
    """The head width d, or the ValueError the contract asks for (each message names the dimension,
    its size and what it must divide into)."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads = {num_heads} is not a multiple of num_kv_heads = {num_kv_heads}")
    if qkv_rows % (num_heads + 2 * num_kv_heads):
        raise ValueError(f"qkv out_features = {qkv_rows} is not a multiple of num_heads + 2 num_kv_heads = {num_heads + 2 * num_kv_heads}")
    if num_kv_heads % n:
        raise ValueError(f"num_kv_heads = {num_kv_heads} is not divisible by the group size {n} ({num_kv_heads} % {n} = {num_kv_heads % n})")
    return qkv_rows // (num_heads + 2 * num_kv_heads)


# ----------------------------------------------------------------------------------- the layouts
def _head_rows(layout: str, num_heads: int, num_kv_heads: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """Row indices of the fused weight for each query head [H, d], key head and value head [H_kv, d]."""
    group = num_heads // num_kv_heads
    if layout == "concatenated":
        q = torch.arange(num_heads * d).reshape(num_heads, d)
        k = num_heads * d + torch.arange(num_kv_heads * d).reshape(num_kv_heads, d)
        return q, k, k + num_kv_heads * d
    if layout != "grouped":
        raise ValueError(f"qkv_layout must be one of {QKV_LAYOUTS}, got {layout!r}")
    block = (group + 2) * d  # one group's rows: G query heads, its key head, its value head
    starts = torch.arange(num_kv_heads) * block
    q = (starts[:, None, None] + torch.arange(group * d).reshape(group, d)).reshape(num_heads, d)
    k = starts[:, None] + group * d + torch.arange(d)
    return q, k, k + d


def _fused(layout: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Per-head row indices put back in ``layout``'s order, for the head counts of q and k."""
    if layout == "concatenated":
        return torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])
    group = q.shape[0] // k.shape[0]
    d = q.shape[1]
    return torch.cat([q.reshape(k.shape[0], group * d), k, v], dim=1).reshape(-1)


def qkv_rows(layout: str, num_heads: int, num_kv_heads: int, d: int, n: int, index: int) -> Tensor:
    """The rows of the dense fused QKV weight that member ``index`` of n keeps, in its local order
    (``layout`` for its H/n query and H_kv/n key/value heads)."""
    q, k, v = _head_rows(layout, num_heads, num_kv_heads, d)
    mine_q, mine_kv = num_heads // n, num_kv_heads // n
    return _fused(
        layout, q[index * mine_q : (index + 1) * mine_q], k[index * mine_kv : (index + 1) * mine_kv], v[index * mine_kv : (index + 1) * mine_kv]
    )


def gate_up_rows(ffn: int, n: int, index: int) -> Tensor:
    """The rows of the dense fused [gate | up] weight member ``index`` of n keeps: [gate_r | up_r]."""
    each = ffn // n
    mine = torch.arange(index * each, (index + 1) * each)
    return torch.cat([mine, ffn + mine])


def rows_of(t: Tensor | None, rows: Tensor) -> Tensor | None:
    return None if t is None else t.index_select(0, rows).clone()


# ------------------------------------------------------------------------------------ the layers
def _autograd(forward, x: Tensor, params: dict[str, Tensor | None], grad_output: Tensor) -> dict[str, Tensor]:
    """forward(x, **params) in float64 and its backward with ``grad_output``: the output and the
    gradients of x and of every parameter (grad_<name>), cast back to x's dtype."""
    dtype = x.dtype
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    p64 = {k: None if v is None else v.detach().to(torch.float64).requires_grad_(True) for k, v in params.items()}
    y = forward(x64, **p64)
    y.backward(grad_output.to(torch.float64))
    out = {"output": y.detach(), "grad_input": x64.grad}
    out.update({f"grad_{k}": v.grad for k, v in p64.items() if v is not None})
    return {k: v.to(dtype) for k, v in out.items()}


def attention_forward(
    x: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor | None,
    out_weight: Tensor,
    out_bias: Tensor | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    layout: str,
) -> Tensor:
    """The dense block of the module docstring, written out head by head."""
    d = check_heads(num_heads, num_kv_heads, qkv_weight.shape[0], 1)
    fused = F.linear(x, qkv_weight, qkv_bias)  # [B, S, (H + 2 H_kv) d]
    q_rows, k_rows, v_rows = _head_rows(layout, num_heads, num_kv_heads, d)
    seq = x.shape[-2]
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    group = num_heads // num_kv_heads
    heads = []
    for i in range(num_heads):
        q, k, v = (fused[..., rows[j]] for rows, j in ((q_rows, i), (k_rows, i // group), (v_rows, i // group)))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(mask, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)
    return F.linear(torch.cat(heads, dim=-1), out_weight, out_bias)


def attention(
    x: Tensor,
    qkv: tuple[Tensor, Tensor | None],
    out: tuple[Tensor, Tensor | None],
    grad_output: Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    layout: str,
) -> dict[str, Tensor]:
    """Forward and backward of the dense attention block: output, grad_input, grad_qkv_weight,
    grad_qkv_bias, grad_out_weight, grad_out_bias (biases only when given)."""

    def forward(x, qkv_weight, qkv_bias, out_weight, out_bias):
        return attention_forward(x, qkv_weight, qkv_bias, out_weight, out_bias, num_heads=num_heads, num_kv_heads=num_kv_heads, layout=layout)

    return _autograd(forward, x, {"qkv_weight": qkv[0], "qkv_bias": qkv[1], "out_weight": out[0], "out_bias": out[1]}, grad_output)


def swiglu_forward(x: Tensor, gate_up_weight: Tensor, gate_up_bias: Tensor | None, down_weight: Tensor, down_bias: Tensor | None) -> Tensor:
    gate, up = F.linear(x, gate_up_weight, gate_up_bias).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_weight, down_bias)


def swiglu(x: Tensor, gate_up: tuple[Tensor, Tensor | None], down: tuple[Tensor, Tensor | None], grad_output: Tensor) -> dict[str, Tensor]:
    """Forward and backward of the dense SwiGLU MLP: output, grad_input, grad_gate_up_weight,
    grad_gate_up_bias, grad_down_weight, grad_down_bias (biases only when given)."""
    return _autograd(
        swiglu_forward, x, {"gate_up_weight": gate_up[0], "gate_up_bias": gate_up[1], "down_weight": down[0], "down_bias": down[1]}, grad_output
    )


def atol(expected: Tensor) -> Tensor:
    """RELATIVE (1 + |expected|), elementwise (the derivation is at RELATIVE)."""
    return RELATIVE * (1 + expected.abs())
