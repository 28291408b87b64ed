"""A small decoder language model with torchtitan's Llama module paths, for ``--parallelize`` (a
team's ``parallelize(model, mesh)`` applies ``fully_shard`` and ``parallelize_module`` plans by these
paths, as torchtitan's ``parallelize_llama`` does). Pure torch.nn: nothing here touches
torch.distributed, so the driver builds the dense twin from the same spec and seed, bitwise.

    h_0 = tok_embeddings[tokens]
    u_l = h_l + attention(attention_norm(h_l))            attention: causal, grouped-query
    h_{l+1} = u_l + feed_forward(ffn_norm(u_l))           feed_forward: w2(silu(w1 x) * w3 x)
    logits = output(norm(h_L))

Module paths: ``tok_embeddings``, ``layers.<l>.attention_norm``, ``layers.<l>.attention.{wq, wk, wv, wo}``,
``layers.<l>.ffn_norm``, ``layers.<l>.feed_forward.{w1, w2, w3}``, ``norm``, ``output``. Attention
reshapes its projections with ``view(batch, seq, -1, head_dim)``, so it runs on the local heads a
column-parallel ``wq``/``wk``/``wv`` leaves on a tensor-parallel rank (torchtitan does the same);
the number of query heads per key/value head is a constant of the module, not of the shard.

Spec: {"vocab", "dim", "heads", "kv_heads", "head_dim", "ffn", "layers", "dtype"}.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang and Sennrich 2019), over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal grouped-query attention: ``heads`` query heads share ``kv_heads`` key/value heads."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"heads = {heads} is not a multiple of kv_heads = {kv_heads}")
        self.head_dim, self.repeats = head_dim, heads // kv_heads
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        k, v = k.repeat_interleave(self.repeats, dim=1), v.repeat_interleave(self.repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, spec: dict):
        super().__init__()
        self.attention_norm = RMSNorm(spec["dim"])
        self.attention = Attention(spec["dim"], spec["heads"], spec["kv_heads"], spec["head_dim"])
        self.ffn_norm = RMSNorm(spec["dim"])
        self.feed_forward = FeedForward(spec["dim"], spec["ffn"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class DecoderLM(nn.Module):
    def __init__(self, spec: dict):
        super().__init__()
        self.tok_embeddings = nn.Embedding(spec["vocab"], spec["dim"])
        self.layers = nn.ModuleList([TransformerBlock(spec) for _ in range(spec["layers"])])
        self.norm = RMSNorm(spec["dim"])
        self.output = nn.Linear(spec["dim"], spec["vocab"], bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build(spec: dict, seed: int) -> DecoderLM:
    """The model ``spec`` describes, every parameter drawn from ``seed`` in named order from a private
    generator (the global RNG is neither used nor disturbed): N(0, 1) / sqrt(fan_in) for the matrices,
    the norms' weights 1 + N(0, 1) / 4 (not all ones, so a norm weight's wrong gradient shows in the
    step), the projections back into the residual stream (``wo``, ``w2``) scaled by 1 / (2 L) so the
    stream stays of order one."""
    model = DecoderLM(spec).to(getattr(torch, spec.get("dtype", "float64")))
    draw_parameters(model, seed, spec["layers"])
    return model


def draw_parameters(model: nn.Module, seed: int, layers: int) -> None:
    """Every parameter of a Llama-shaped ``model`` drawn again from ``seed`` in named order, as ``build``
    says (also torchtitan's Llama: harness/rank/torchtitan_llama.py)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
            if tensor.dim() == 1:
                value = 1 + noise / 4
            else:
                residual = 1.0 / (2 * layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0
                value = noise * residual / math.sqrt(tensor.shape[-1])
            tensor.copy_(value.to(tensor.dtype))


def make_tokens(spec: dict, rows: int, seq: int, seed: int, ignored: float = 0.0) -> dict:
    """{"inputs": [rows, seq] token ids, "targets": [rows, seq]} drawn from ``seed``; with ``ignored``
    > 0 about that fraction of the targets is -100 (cross entropy's ignore_index: padding), never a
    whole batch of them."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, spec["vocab"], (rows, seq), generator=generator)
    targets = torch.randint(0, spec["vocab"], (rows, seq), generator=generator)
    if ignored > 0:
        dropped = torch.rand((rows, seq), generator=generator) < ignored
        dropped.view(-1)[0] = False
        targets = targets.masked_fill(dropped, -100)
    return {"inputs": inputs, "targets": targets}
