"""Single-process truth for the whole-block mesh test: a small language model of causal
self-attention and SwiGLU blocks with a tied embedding and output head, in float64.

    h_0 = E[tokens]                                   (E: [V, h], the embedding)
    h_{b+1} = u_b + SwiGLU_b(u_b),  u_b = h_b + Attn_b(h_b)   (residuals; no norm)
    logits = h_L E^T                                  (the head is E: tied, Press and Wolf 2017)
    loss = mean over tokens of CE(logits, targets)

Attn and SwiGLU are reference/transformer_layers.py's dense blocks (grouped-query attention with a
fused QKV in the given layout; SwiGLU with fused [gate | up]). The pipeline's loss is the mean over
its m microbatches of each microbatch's mean, and the data-parallel average of the replicas' losses;
with microbatches of equal token counts that is this loss on the global batch, so the gradient every
shard is judged against is the gradient of ``loss`` here, the embedding's being the sum of its two
uses. Never imports torch.distributed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from parallelism_conformance.reference.transformer_layers import attention_forward, swiglu_forward


def forward(params: dict[str, Tensor], tokens: Tensor, spec: dict) -> Tensor:
    """The logits [..., seq, V] of ``params`` ({name: tensor}, the names of
    harness/rank/pipeline_models.build_transformer) on ``tokens`` [..., seq]."""
    h = F.embedding(tokens, params["embed.weight"])
    for b in range(spec["blocks"]):
        p = {key.removeprefix(f"blocks.{b}."): value for key, value in params.items() if key.startswith(f"blocks.{b}.")}
        h = h + attention_forward(
            h,
            p["attn.qkv.weight"],
            p.get("attn.qkv.bias"),
            p["attn.out.weight"],
            p.get("attn.out.bias"),
            num_heads=spec["heads"],
            num_kv_heads=spec["kv_heads"],
            layout=spec["layout"],
        )
        h = h + swiglu_forward(h, p["mlp.gate_up.weight"], p.get("mlp.gate_up.bias"), p["mlp.down.weight"], p.get("mlp.down.bias"))
    return h @ params["embed.weight"].T


def loss_and_grads(params: dict[str, Tensor], tokens: Tensor, targets: Tensor, spec: dict) -> tuple[Tensor, dict]:
    """(the mean cross entropy over every token, {name: its gradient}), in float64."""
    leaves = {name: t.detach().to(torch.float64).requires_grad_(True) for name, t in params.items()}
    logits = forward(leaves, tokens, spec)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return loss.detach(), {name: t.grad for name, t in leaves.items()}
