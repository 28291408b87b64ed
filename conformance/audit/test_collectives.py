"""The communication audit of collectives (the rules: harness/driver/audit.py; the bounds:
reference/cost_model.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parallelism_conformance.conformance.audit.collective_calls import COLLECTIVES, collective_case
from parallelism_conformance.conformance.audit.common import Audited, audits, check
from parallelism_conformance.conformance.examples import Layout, layouts
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.driver import audit

pytestmark = pytest.mark.capability("audit")


def run_collective(audited: Audited, request, data, name: str):
    labels: list[str] = []

    def draw(label, strategy):
        value = data.draw(strategy, label=label)
        labels.append(f"{label}={value}")
        return value

    layout = data.draw(layouts(audited.target.max_world_size, min_size=2), label="layout")
    if layout.size < 2:
        pytest.skip("needs a group of at least 2 ranks (--max-world-size)")
    function, args, bounds, what = collective_case(name, draw, layout, refused_for=audited.refused_dtypes)
    judge = Judge(f"{layout}, " + ", ".join(labels), audited.target.reproduce(request.node.nodeid))
    per_member = [{"function": function, "arguments": a} for a in args]
    _, records = audited.run(judge, layout, "collectives:call", per_member)
    return judge, layout, records, bounds, what


@pytest.mark.parametrize("name", COLLECTIVES)
def test_point_to_point_only(name, audited, request, reproduce):
    """The collective makes send/recv calls only, on every rank. Where the rule is not required
    (--audit-require-p2p), one representative call is made and what it sent is the skip's reason."""
    audits(request, name)
    if audited.require_p2p:
        _point_to_point_only_examples(name=name, audited=audited, request=request)
        return
    layout = Layout(min(2, audited.target.max_world_size))
    if layout.size < 2:
        pytest.skip("needs a world of at least 2 ranks (--max-world-size)")
    fixed = {"dtype": torch.float32, "op": "SUM", "seed": 0, "shape": (1024,), "root": 0, "input_split_sizes": [[512, 512], [512, 512]]}
    function, args, bounds, what = collective_case(name, lambda label, _: fixed[label], layout, refused_for=audited.refused_dtypes)
    judge = Judge(f"{layout}, 1024 x float32", reproduce)
    _, records = audited.run(judge, layout, "collectives:call", [{"function": function, "arguments": a} for a in args])
    seen = "; ".join(f"rank {r}: {audit.describe(rs)}" for r, rs in sorted(records.items()))
    pytest.skip(
        f"not applicable: {audited.target.impl} is not required to be built from point-to-point "
        f"(--audit-require-p2p={request.config.getoption('--audit-require-p2p')}); observed for {what}: {seen}"
    )


@given(data=st.data())
def _point_to_point_only_examples(data, name, audited, request):
    judge, layout, records, _, _ = run_collective(audited, request, data, name)
    check(judge, audit.point_to_point_only(records))


@pytest.mark.parametrize("name", COLLECTIVES)
@given(data=st.data())
def test_bytes_sent_within_bound(name, data, audited, request):
    """Every rank sends at most the cost model's per-rank bound for the call; non-members nothing."""
    audits(request, name)
    judge, layout, records, bounds, what = run_collective(audited, request, data, name)
    check(judge, audit.within_bound(records, bounds, what))


@pytest.mark.parametrize("name", COLLECTIVES)
def test_bytes_sent_within_bound_at_the_largest_world(name, audited, request, reproduce):
    """The same rule on one fixed example that Hypothesis may not reach: the whole of the largest
    world (where a linear broadcast or a gather-everything all-reduce costs the most), 1001
    float32 elements (divisible by none of 2..8 but 7), a non-zero root, uneven all-to-all splits."""
    audits(request, name)
    n = audited.target.max_world_size
    if n < 2:
        pytest.skip("needs a world of at least 2 ranks (--max-world-size)")
    layout = Layout(n)
    fixed = {
        "dtype": torch.float32,
        "op": "SUM",
        "seed": 0,
        "root": n - 1,
        "shape": (251 * n,) if name == "reduce_scatter_tensor" else (1001,),
        "input_split_sizes": [[(3 * i + 5 * j) % 17 for j in range(n)] for i in range(n)],
    }
    function, args, bounds, what = collective_case(name, lambda label, _: fixed[label], layout, refused_for=audited.refused_dtypes)
    judge = Judge(f"{layout}, {fixed['shape']} float32, root {n - 1}", reproduce)
    _, records = audited.run(judge, layout, "collectives:call", [{"function": function, "arguments": a} for a in args])
    check(judge, audit.within_bound(records, bounds, what))
