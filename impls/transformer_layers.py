"""Tensor-parallel attention with a fused QKV projection and grouped-query attention, and a
tensor-parallel SwiGLU MLP with a fused gate/up projection, built from the column- and
row-parallel layers of :mod:`impls.tensor_parallel` (Megatron-LM, Shoeybi et al. 2019, section 3).

A fused projection is column parallel by meaning, not by position: a rank must keep whole heads
(its query heads and the key/value heads they attend with) and, for SwiGLU, the gate rows and the
value rows of the same hidden units. Cutting the fused weight into n contiguous chunks of rows
does neither unless the dense layout was made for it (NVIDIA-NeMo/Automodel#1324), so each layer
picks its rows by index and lays them out as a dense layer of its own head counts would be.

Attention: qkv of width (H + 2 H_kv) d, query head i attends with key/value head i // (H / H_kv);
``qkv_layout`` ``concatenated`` is [Q | K | V], ``grouped`` is Megatron-LM's [q.. k v] per
key/value group. Rank r keeps query heads [r H/n, (r + 1) H/n) and key/value heads
[r H_kv/n, (r + 1) H_kv/n) (whole groups: n must divide H_kv) and the matching columns of the
output projection, which is row parallel. SwiGLU: y = (silu(a) * b) W_down^T + b_down with
[a | b] = x W_gu^T + b_gu; rank r keeps rows r of the gate's f rows and of the value's.

With sequence_parallel the input and output are this rank's shard of the sequence (dim -2): the
column layer all-gathers it before the projection (backward: reduce-scatter), the row layer
reduce-scatters after it (backward: all-gather), and attention runs on the whole gathered
sequence, so the causal mask sees global positions.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["TensorParallelAttention", "TensorParallelSwiGLU"]

QKV_LAYOUTS = ("concatenated", "grouped")


def _divisible(dimension: str, size: int, n: int) -> None:
    if size % n:
        raise ValueError(f"{dimension} = {size} is not divisible by the group size {n} ({size} % {n} = {size % n})")


def _rows(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.detach().index_select(0, index.to(t.device))


def _my_qkv_rows(layout: str, heads: int, kv_heads: int, d: int, n: int, r: int) -> torch.Tensor:
    """This rank's rows of the dense fused weight, in ``layout`` for its own head counts."""
    group, my_kv = heads // kv_heads, kv_heads // n
    if layout == "grouped":  # whole groups are contiguous: a plain chunk
        block = my_kv * (group + 2) * d
        return torch.arange(r * block, (r + 1) * block)
    q = torch.arange(r * my_kv * group * d, (r + 1) * my_kv * group * d)
    k = heads * d + torch.arange(r * my_kv * d, (r + 1) * my_kv * d)
    return torch.cat([q, k, k + kv_heads * d])


class TensorParallelAttention(nn.Module):
    """Causal self-attention over [batch, seq, h] with this rank's heads."""

    def __init__(self, qkv: ColumnParallelLinear, out: RowParallelLinear, heads: int, kv_heads: int, d: int, layout: str):
        super().__init__()
        self.qkv, self.out = qkv, out
        self.heads, self.kv_heads, self.head_dim, self.layout = heads, kv_heads, d, layout  # this rank's

    @classmethod
    def from_dense(
        cls,
        qkv: nn.Linear,
        out: nn.Linear,
        num_heads: int,
        num_kv_heads: int,
        group=None,
        sequence_parallel: bool = False,
        qkv_layout: str = "concatenated",
    ) -> TensorParallelAttention:
        n, r = dist.get_world_size(group), dist.get_rank(group)
        if qkv_layout not in QKV_LAYOUTS:
            raise ValueError(f"qkv_layout must be one of {QKV_LAYOUTS}, got {qkv_layout!r}")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads = {num_heads} is not a multiple of num_kv_heads = {num_kv_heads}")
        if qkv.out_features % (num_heads + 2 * num_kv_heads):
            raise ValueError(
                f"qkv out_features = {qkv.out_features} is not a multiple of num_heads + 2 num_kv_heads = {num_heads + 2 * num_kv_heads}"
            )
        d = qkv.out_features // (num_heads + 2 * num_kv_heads)
        if out.in_features != num_heads * d:
            raise ValueError(f"out in_features = {out.in_features} must be num_heads * head_dim = {num_heads * d}")
        _divisible("num_kv_heads", num_kv_heads, n)
        rows = _my_qkv_rows(qkv_layout, num_heads, num_kv_heads, d, n, r)
        column = ColumnParallelLinear(_rows(qkv.weight, rows), _rows(qkv.bias, rows), group, sequence_parallel=sequence_parallel)
        row = RowParallelLinear.from_dense(out, group, sequence_parallel=sequence_parallel)
        return cls(column, row, num_heads // n, num_kv_heads // n, d, qkv_layout)

    def _split_heads(self, fused: torch.Tensor):
        """q [B, H_r, S, d], k and v [B, H_kv_r, S, d] from this rank's fused projection."""
        *lead, seq, _ = fused.shape
        group, d = self.heads // self.kv_heads, self.head_dim
        if self.layout == "concatenated":
            q, k, v = fused.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        else:
            blocks = fused.reshape(*lead, seq, self.kv_heads, (group + 2) * d)
            q, k, v = blocks.split([group * d, d, d], dim=-1)
        shape = (*lead, seq, -1, d)
        return (t.reshape(shape).transpose(-2, -3) for t in (q, k, v))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split_heads(self.qkv(x))
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)  # head i uses i // G
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        seq = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v  # [B, H_r, S, d]
        return self.out(o.transpose(-2, -3).flatten(-2))


class TensorParallelSwiGLU(nn.Module):
    """(silu(a) * b) W_down^T + b_down with [a | b] this rank's gate and value columns."""

    def __init__(self, gate_up: ColumnParallelLinear, down: RowParallelLinear):
        super().__init__()
        self.gate_up, self.down = gate_up, down

    @classmethod
    def from_dense(cls, gate_up: nn.Linear, down: nn.Linear, group=None, sequence_parallel: bool = False) -> TensorParallelSwiGLU:
        n, r = dist.get_world_size(group), dist.get_rank(group)
        if gate_up.out_features % 2:
            raise ValueError(f"gate_up out_features = {gate_up.out_features} must be 2 ffn (gate rows, then up rows)")
        ffn = gate_up.out_features // 2
        if down.in_features != ffn:
            raise ValueError(f"down in_features = {down.in_features} must equal ffn = gate_up out_features / 2 = {ffn}")
        _divisible("ffn", ffn, n)
        each = ffn // n
        mine = torch.arange(r * each, (r + 1) * each)
        rows = torch.cat([mine, ffn + mine])
        column = ColumnParallelLinear(_rows(gate_up.weight, rows), _rows(gate_up.bias, rows), group, sequence_parallel=sequence_parallel)
        return cls(column, RowParallelLinear.from_dense(down, group, sequence_parallel=sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
