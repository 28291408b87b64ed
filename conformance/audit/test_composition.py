"""The communication audit of composition (the rules: harness/driver/audit.py; the bounds:
reference/cost_model.py)."""

from __future__ import annotations

import pytest
import torch

from parallelism_conformance.conformance.audit.common import audits, check
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.driver import audit
from parallelism_conformance.reference import cost_model

pytestmark = pytest.mark.capability("audit")


def test_composition_traffic_on_hosts(audited, request, reproduce):
    """A dp=2 x tp=2 mesh on 2 hosts of 2 ranks (reference/topology.py): tensor parallelism's groups
    (the mesh's rows) sit within a host; every byte each rank sends is attributed to a link class
    (within a host, across hosts) and held to the cost model's prediction: within a host at most the
    TP MLP's traffic (cost_model.tensor_parallel_mlp), across hosts at most the data-parallel sum of
    the gradient shards (one all-reduce each over a column); building the layers ("setup") is not
    judged. The bytes per link class are reported (JUnit property "bytes_by_link")."""
    import json

    from parallelism_conformance.reference import mesh
    from parallelism_conformance.reference.topology import ACROSS, WITHIN, HostLayout

    audits(request, "composition")
    if audited.target.max_world_size < 4:
        pytest.skip("needs 4 ranks (--max-world-size)")
    layout, dp, tp, h, ffn, rows = HostLayout(2, 2), 2, 2, 4, 8, 3
    from parallelism_conformance.conformance.examples import dense_layers

    t = dense_layers(5, torch.float32, [(h, ffn), (ffn, h)], True, (dp * rows, h), (dp * rows, h))
    (w1, b1), (w2, b2) = t["params"]
    rows_groups, column_groups = mesh.tensor_parallel_groups(dp, tp), mesh.data_parallel_groups(dp, tp)
    weights = {"fc1_weight": w1, "fc1_bias": b1, "fc2_weight": w2, "fc2_bias": b2}
    per_rank = [
        {
            "tensor_parallel_groups": rows_groups,
            "data_parallel_groups": column_groups,
            "dense": weights,
            "x": t["x"].chunk(dp)[mesh.coordinates(r, dp, tp)[0]].contiguous(),
            "grad_output": t["g"].chunk(dp)[mesh.coordinates(r, dp, tp)[0]].contiguous(),
        }
        for r in range(dp * tp)
    ]
    judge = Judge(f"mesh dp={dp} x tp={tp} on {layout}, h={h}, ffn={ffn}, {rows} rows per replica, float32", reproduce)
    _, records = audited.run(judge, Layout(dp * tp), "composition:dp_tp_mlp", per_rank)
    itemsize = 4
    within = cost_model.tensor_parallel_mlp(tp, rows * h, itemsize)
    shard_numels = [ffn // tp * h, ffn // tp, h * ffn // tp, h]
    across = sum(cost_model.all_reduce(dp, numel, itemsize) for numel in shard_numels)
    by_link = audit.bytes_by_link(records, layout, phase=("forward", "backward", "data_parallel"))
    request.node.user_properties.append(("bytes_by_link", json.dumps(by_link)))
    by_axis = audit.bytes_by_axis(records, layout, {"tp": rows_groups, "dp": column_groups}, phase=("forward", "backward", "data_parallel"))
    request.node.user_properties.append(("link_report", f"dp={dp} x tp={tp} mesh on {layout}: {audit.link_report(by_axis)}"))
    violations = audit.groups_within_hosts(rows_groups, layout, "tensor-parallel")
    for rank, totals in by_link.items():
        if totals[WITHIN] > within["forward"] + within["backward"]:
            violations.append(
                f"rank {rank}: {totals[WITHIN]} B sent within its host, more than the TP MLP's {within['forward'] + within['backward']} B"
            )
        if totals[ACROSS] > across:
            violations.append(
                f"rank {rank}: {totals[ACROSS]} B sent across hosts, more than the data-parallel sum of "
                f"its gradient shards, {across} B (all_reduce over a column of {dp}): frequent "
                f"communication crossed the slow links"
            )
    check(judge, violations)
