"""Conformance of clipping by the global norm over an expert-parallel layer (capability
``moe_clipping``): ``clip_grad_norm_(moe, max_norm, norm_type)`` on the implementation's
``ExpertParallelMoE``, whose members each hold a block of the experts and the replicated router.

Reported bugs this is for: clipping by a local norm (torchtitan#596 and #649, where the local part was
a pipeline stage's; here a member's experts), and a replicated weight counted once per member
(ROCm/TransformerEngine#715: replicated weights counted tp-size times, the norm 1.52x at TP = 8).
Either clips by a wrong norm, which a loss curve shows only as a slightly different run.

Each example draws the layer of conformance/test_expert_parallel.py (1-4 members, 1-2 experts each,
each member's own tokens, float64), a norm type (2, 1, inf) and max_norm (0.25, 0.5 or 4 times the
norm). The ranks run forward and backward, sum the router's gradient over the group with the
implementation's all_reduce (a trainer's reduction of a replicated parameter), and clip
(harness/rank/programs/expert_parallel.py: clip). In the driver, against one process over every
member's tokens (reference/expert_parallel.py): the returned norm, that of the router's and every
expert's gradient as one vector, bitwise the same on every member; the clipped router gradient and
each member's clipped experts.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import parallelism_conformance.reference.data_parallel as dp_ref
import parallelism_conformance.reference.expert_parallel as ref
from parallelism_conformance.conformance.examples import mixture_examples
from parallelism_conformance.conformance.test_expert_parallel import judge_expert_gradients
from parallelism_conformance.conformance.verdict import Judge


@pytest.mark.capability("moe_clipping")
@given(data=st.data())
def test_the_norm_counts_every_expert_once_and_the_router_once(data, ranks, target, reproduce):
    example = data.draw(mixture_examples(target.max_world_size), label="example")
    t = example.tensors()
    assume(ref.top2_gap(torch.cat(t["xs"]), t["router"]) > ref.ROUTING_TIE)
    norm_type = data.draw(st.sampled_from([2.0, 1.0, math.inf]), label="norm_type")
    factor = data.draw(st.sampled_from([0.25, 0.5, 4.0]), label="max_norm / norm")
    expected = ref.moe(t["xs"], t["router"], t["experts"], t["grads"])
    router = sum(expected["grad_router"][1:], expected["grad_router"][0])
    grads = [router, *(g for expert in expected["grad_experts"] for g in expert)]
    norm = dp_ref.total_norm(grads, norm_type)
    max_norm = float(norm) * factor
    coefficient = min(1.0, max_norm / (float(norm) + 1e-6))
    n = example.layout.size
    judge = Judge(f"{example}, norm_type={norm_type}, max_norm={max_norm:.6g} ({factor} x the norm)", reproduce)
    outputs = judge.run(
        ranks,
        example.layout,
        "expert_parallel:clip",
        [
            {
                "router_weight": t["router"],
                "experts": t["experts"],
                "x": t["xs"][i],
                "grad_output": t["grads"][i],
                "max_norm": max_norm,
                "norm_type": norm_type,
            }
            for i in range(n)
        ],
    )
    scaled = [tuple(g * coefficient for g in expert) for expert in expected["grad_experts"]]
    for i, rank in enumerate(example.layout.ranks):
        got, where = outputs[rank], f"rank {rank} (group rank {i})"
        if not torch.is_tensor(got["norm"]) or got["norm"].numel() != 1:
            judge.fail(f"{where}: clip_grad_norm_ returned {got['norm']!r}, not a one-element tensor")
        judge.tensor(
            got["norm"].double().reshape(()),
            norm,
            atol=ref.atol(norm),
            what=f"{where} norm: of the router's gradient (once) and every expert's (each on its member)",
        )
        judge.tensor(
            got["grad_router"],
            router * coefficient,
            atol=ref.atol(router),
            what=f"{where} clipped router gradient (times min(1, max_norm / (norm + 1e-6)) = {coefficient:.6g})",
        )
        judge_expert_gradients(judge, where, got["grad_experts"], scaled, i, example.experts_per_rank, f"clipped, times {coefficient:.6g}")
    judge.bitwise_identical({rank: outputs[rank]["norm"].reshape(()) for rank in example.layout.ranks}, what="the returned norm")
