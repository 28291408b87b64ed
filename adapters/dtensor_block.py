"""torch's own tensor parallelism (DTensor's ``ColwiseParallel`` and ``RowwiseParallel`` plans)
through the contract's tensor-parallel attention and SwiGLU (CONTRACT.md, "Attention and SwiGLU");
adapters/torch_native.py re-exports them.

``ColwiseParallel`` shards a weight's rows into n contiguous chunks, which is right for a fused
projection only when its rows are laid out for it (NVIDIA-NeMo/Automodel#1324; torchtitan keeps
wq, wk, wv and w1, w3 apart for this reason). The adapter therefore permutes the dense fused rows
once, before ``parallelize_module``, so that chunk r holds member r's rows in the contract's local
layout: its query heads, then its key heads, then its value heads (or its whole groups, in the
grouped layout), or its gate rows, then its value rows. The rest is torch's: the all-reduce of the
input gradient, the row layer's all-reduce (or, under sequence parallelism, the all-gather of the
sequence before the column layer and the reduce-scatter after the row layer: rows in (sequence,
batch) order, as in adapters/dtensor_tp.py), and ``F.scaled_dot_product_attention(is_causal=True,
enable_gqa=True)`` on the local heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from parallelism_conformance.adapters.dtensor_tp import _check_divisible, _copy, _mesh

__all__ = ["TensorParallelAttention", "TensorParallelSwiGLU"]

QKV_LAYOUTS = ("concatenated", "grouped")


def _permuted(linear: nn.Linear, order: torch.Tensor) -> nn.Module:
    """A copy of ``linear`` whose rows are ``linear``'s rows in ``order``."""
    new = _copy(linear)
    with torch.no_grad():
        new.weight.copy_(linear.weight[order])
        if linear.bias is not None:
            new.bias.copy_(linear.bias[order])
    return new


def _qkv_order(layout: str, heads: int, kv_heads: int, d: int, n: int) -> torch.Tensor:
    """The dense fused rows, member by member, each member's in the layout for its own head counts."""
    if layout == "grouped":  # whole groups are contiguous already
        return torch.arange((heads + 2 * kv_heads) * d)
    q_each, kv_each = heads * d // n, kv_heads * d // n
    return torch.cat(
        [
            torch.cat(
                [
                    torch.arange(r * q_each, (r + 1) * q_each),
                    heads * d + torch.arange(r * kv_each, (r + 1) * kv_each),
                    (heads + kv_heads) * d + torch.arange(r * kv_each, (r + 1) * kv_each),
                ]
            )
            for r in range(n)
        ]
    )


class _Sequence(nn.Module):
    """The parallelized column layer, a local computation, the parallelized row layer, fed rows:
    [batch * seq, h], or under sequence parallelism [seq * batch, h] with this member's shard of the
    sequence as a Shard(0) of the rows (DTensor all-gathers it in the column layer and
    reduce-scatters after the row layer)."""

    def __init__(self, first: nn.Module, second: nn.Module, group, sequence_parallel: bool):
        super().__init__()
        self.first, self.second, self.sequence_parallel = first, second, sequence_parallel
        plan = (
            {"first": ColwiseParallel(input_layouts=Shard(0)), "second": RowwiseParallel(output_layouts=Shard(0))}
            if sequence_parallel
            else {"first": ColwiseParallel(), "second": RowwiseParallel()}
        )
        parallelize_module(self, _mesh(group), plan)

    def middle(self, hidden: torch.Tensor) -> torch.Tensor:
        """This member's computation between the two layers, on [..., seq, local width]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            hidden = self.first(x.reshape(-1, x.shape[-1]))
            mid = self.middle(hidden.reshape(*x.shape[:-1], hidden.shape[-1]))
            y = self.second(mid.reshape(-1, mid.shape[-1]))
            return y.reshape(*x.shape[:-1], y.shape[-1])
        if x.dim() < 2:
            raise ValueError(f"sequence parallelism needs inputs of shape [..., sequence, hidden], got {tuple(x.shape)}")
        batch, (seq, width) = x.shape[:-2], x.shape[-2:]
        sequences = x.reshape(-1, seq, width)
        rows = sequences.transpose(0, 1).reshape(-1, width)  # [seq shard * batch, h]
        hidden = self.first(rows)  # [whole seq * batch, local width]: gathered
        hidden = hidden.reshape(-1, sequences.shape[0], hidden.shape[-1]).transpose(0, 1)  # [batch, whole seq, w]
        mid = self.middle(hidden)
        y = self.second(mid.transpose(0, 1).reshape(-1, mid.shape[-1]))  # [seq shard * batch, h]: reduce-scattered
        return y.reshape(seq, -1, y.shape[-1]).transpose(0, 1).reshape(*batch, seq, y.shape[-1])


class _Attention(_Sequence):
    def __init__(self, qkv, out, group, sequence_parallel, heads: int, kv_heads: int, d: int, layout: str):
        super().__init__(qkv, out, group, sequence_parallel)
        self.heads, self.kv_heads, self.head_dim, self.layout = heads, kv_heads, d, layout  # this member's

    @property
    def qkv(self):
        return self.first

    @property
    def out(self):
        return self.second

    def middle(self, fused: torch.Tensor) -> torch.Tensor:
        *lead, seq, _ = fused.shape
        group, d = self.heads // self.kv_heads, self.head_dim
        if self.layout == "concatenated":
            q, k, v = fused.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        else:
            q, k, v = fused.reshape(*lead, seq, self.kv_heads, (group + 2) * d).split([group * d, d, d], dim=-1)
        q, k, v = (t.reshape(*lead, seq, -1, d).transpose(-2, -3) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o.transpose(-2, -3).flatten(-2)


class _SwiGLU(_Sequence):
    @property
    def gate_up(self):
        return self.first

    @property
    def down(self):
        return self.second

    def middle(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = hidden.chunk(2, dim=-1)
        return F.silu(gate) * up


class TensorParallelAttention:
    @staticmethod
    def from_dense(
        qkv: nn.Linear,
        out: nn.Linear,
        num_heads: int,
        num_kv_heads: int,
        group=None,
        sequence_parallel: bool = False,
        qkv_layout: str = "concatenated",
    ) -> nn.Module:
        n = dist.get_world_size(group)
        if qkv_layout not in QKV_LAYOUTS:
            raise ValueError(f"qkv_layout must be one of {QKV_LAYOUTS}, got {qkv_layout!r}")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads = {num_heads} is not a multiple of num_kv_heads = {num_kv_heads}")
        if qkv.out_features % (num_heads + 2 * num_kv_heads):
            raise ValueError(
                f"qkv out_features = {qkv.out_features} is not a multiple of num_heads + 2 num_kv_heads = {num_heads + 2 * num_kv_heads}"
            )
        _check_divisible("num_kv_heads", num_kv_heads, n)
        d = qkv.out_features // (num_heads + 2 * num_kv_heads)
        order = _qkv_order(qkv_layout, num_heads, num_kv_heads, d, n)
        return _Attention(_permuted(qkv, order), _copy(out), group, sequence_parallel, num_heads // n, num_kv_heads // n, d, qkv_layout)


class TensorParallelSwiGLU:
    @staticmethod
    def from_dense(gate_up: nn.Linear, down: nn.Linear, group=None, sequence_parallel: bool = False) -> nn.Module:
        n = dist.get_world_size(group)
        if gate_up.out_features % 2:
            raise ValueError(f"gate_up out_features = {gate_up.out_features} must be 2 ffn (gate rows, then up rows)")
        ffn = gate_up.out_features // 2
        _check_divisible("ffn", ffn, n)
        each = ffn // n
        order = torch.cat([torch.cat([torch.arange(r * each, (r + 1) * each), ffn + torch.arange(r * each, (r + 1) * each)]) for r in range(n)])
        return _SwiGLU(_permuted(gate_up, order), _copy(down), group, sequence_parallel)
