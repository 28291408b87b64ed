"""The communication audit of expert parallel (the rules: harness/driver/audit.py; the bounds:
reference/cost_model.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from parallelism_conformance.conformance.audit.common import audits, check
from parallelism_conformance.conformance.examples import mixture_examples
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.driver import audit
from parallelism_conformance.reference import cost_model

pytestmark = pytest.mark.capability("audit")


@pytest.mark.min_ranks(2)
@given(data=st.data())
def test_expert_parallel_traffic(data, audited, request, reproduce):
    """Top-1 MoE: only the tokens whose expert lives elsewhere travel, and their results come back
    (forward, plus the per-expert counts); backward the same bytes the other way
    (cost_model.expert_parallel_moe, from the routing the driver computes). Gathering every token
    everywhere, or sending counts per token, is reported with the numbers."""
    audits(request, "expert_parallel")
    import parallelism_conformance.reference.expert_parallel as moe

    example = data.draw(mixture_examples(audited.target.max_world_size, min_size=2), label="example")
    layout, n, h, num_experts = example.layout, example.layout.size, example.h, example.num_experts
    t = example.tensors()
    router, experts, xs = t["router"], t["experts"], t["xs"]
    assume(moe.top2_gap(torch.cat(xs), router) > moe.ROUTING_TIE)
    routed = moe.routed(xs, router, n)
    judge = Judge(str(example), reproduce)
    _, records = audited.run(
        judge,
        layout,
        "audit:expert_parallel",
        [{"router_weight": router, "experts": experts, "x": xs[i], "grad_output": t["grads"][i]} for i in range(n)],
    )
    budgets = {rank: cost_model.expert_parallel_moe(routed, i, h, 8, num_experts) for i, rank in enumerate(layout.ranks)}
    violations = []
    for phase in ("forward", "backward"):
        violations += audit.within_bound(
            records,
            {rank: budget[phase] for rank, budget in budgets.items()},
            f"the MoE layer's {phase} (tokens routed from member s to member d: {routed}, rows of {h} float64"
            + (", and the per-expert counts" if phase == "forward" else "")
            + ")",
            phase=phase,
        )
    check(judge, violations)
