"""Rank program for context parallelism: this member's rows of Q, K, V (the load-balanced shard the
driver cut: chunks i and 2n-1-i of 2n) and of the upstream gradient; forward through the
implementation's ``context_parallel_attention(q, k, v, seq_len, causal=False, group=None)``,
backward, and return this member's output rows and dQ, dK, dV (CONTRACT.md, "Context parallelism")."""

from __future__ import annotations

from parallelism_conformance.harness.rank import recording
from parallelism_conformance.harness.rank.context import RankContext, on_members, require


@on_members
def attention(ctx: RankContext, impl, process_group, q, k, v, grad_output, seq_len: int, causal: bool) -> dict:
    attend = require(impl, "context_parallel_attention")
    leaves = [ctx.to_device(t).requires_grad_(True) for t in (q, k, v)]
    recording.mark("forward")
    out = attend(*leaves, seq_len, causal=causal, group=process_group)
    recording.mark("backward")
    out.backward(ctx.to_device(grad_output))
    recording.mark("after")
    grads = [t.grad if t.grad is not None else t.detach() * 0 for t in leaves]
    return ctx.to_cpu({"output": out, "grad_q": grads[0], "grad_k": grads[1], "grad_v": grads[2]})
