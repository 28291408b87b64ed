"""The communication audit of context parallel (the rules: harness/driver/audit.py; the bounds:
reference/cost_model.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallelism_conformance.conformance.attention_examples import attention_examples
from parallelism_conformance.conformance.audit.common import audits, check
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.driver import audit
from parallelism_conformance.reference import cost_model

pytestmark = pytest.mark.capability("audit")


@pytest.mark.min_ranks(2)
@given(data=st.data())
def test_context_parallel_traffic(data, audited, request, reproduce):
    """Ring attention: forward, each rank passes on the K/V blocks it holds except the last it
    receives ((n-1) blocks); backward, the blocks' gradients go back, with the blocks passed around
    again where they were not kept (cost_model.ring_attention). Gathering every block everywhere,
    or sending K and V twice forward, is reported with the numbers."""
    import parallelism_conformance.reference.context_parallel as attention

    audits(request, "context_parallel")
    example = data.draw(attention_examples(audited.target.max_world_size, min_size=2), label="example")
    layout, n = example.layout, example.layout.size
    t = example.tensors()
    itemsize = t["k"].element_size()
    rows = [len(attention.positions(example.seq_len, n, i)) for i in range(n)]
    blocks = [2 * example.heads * r * example.width * itemsize for r in rows]
    judge = Judge(str(example), reproduce)
    _, records = audited.run(
        judge,
        layout,
        "context_parallel:attention",
        [
            {
                **{name: attention.shard(t[name], n, i) for name in ("q", "k", "v", "grad_output")},
                "seq_len": example.seq_len,
                "causal": example.causal,
            }
            for i in range(n)
        ],
    )
    budgets = {rank: cost_model.ring_attention(blocks, i) for i, rank in enumerate(layout.ranks)}
    violations = []
    for phase in ("forward", "backward"):
        violations += audit.within_bound(
            records,
            {r: b[phase] for r, b in budgets.items()},
            f"ring attention {phase}: the K/V blocks ({blocks} B by group rank) passed on along the ring",
            phase=phase,
        )
    check(judge, violations)
