"""The communication audit of mesh composition (the rules: harness/driver/audit.py; the bounds:
reference/cost_model.py)."""

from __future__ import annotations

import pytest
import torch

from parallelism_conformance.conformance.audit.common import PIPELINE_METADATA_BYTES, audits, check
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.driver import audit
from parallelism_conformance.reference import cost_model

pytestmark = pytest.mark.capability("audit")


def test_mesh_traffic_on_hosts(audited, request, reproduce):
    """A pp=2 x dp=1 x tp=2 mesh on 2 hosts of 2 ranks (reference/mesh.py, ``Mesh``; the pipeline
    outermost, so each tensor-parallel group sits within a host and each pipeline group crosses
    hosts). Every byte a rank sends is charged to the mesh axis it travels along and to the link it
    crosses (audit.bytes_by_axis): tensor-parallel traffic only within a host (its volume is the TP
    MLP's audit's to judge, test_tensor_parallel_traffic; torch.distributed.pipelining adds a
    shape-inference forward to every new stage); pipeline traffic at most one activation forward
    and one gradient backward per microbatch (cost_model.pipeline_stage) plus
    PIPELINE_METADATA_BYTES per message; nothing along no axis of the mesh.
    The bytes per axis and link class are reported (JUnit property "bytes_by_link", and the run's
    "communication by mesh axis and link class" section)."""
    import json

    from parallelism_conformance.harness.rank import pipeline_models
    from parallelism_conformance.reference.mesh import Mesh
    from parallelism_conformance.reference.topology import ACROSS, WITHIN, HostLayout

    audits(request, "mesh_composition")
    if audited.target.max_world_size < 4:
        pytest.skip("needs 4 ranks (--max-world-size)")
    layout, grid = HostLayout(2, 2), Mesh(2, 1, 2)
    h, ffn, m, samples, blocks = 16, 32, 2, 6, [1, 2]  # equal microbatches: torch's pipelining needs them
    model = {"h": h, "ffn": ffn, "blocks": sum(blocks), "bias": True, "dtype": "float32"}
    batch = pipeline_models.make_block_batch(model, samples, seed=3)
    axes = {axis: grid.groups(axis) for axis in ("tp", "pp", "dp")}
    per_rank = [
        {
            "model": model,
            "seed": 3,
            "blocks_per_stage": blocks,
            "num_microbatches": m,
            "loss": "mse",
            "schedule": "1f1b",
            "mesh": {axis: grid.groups(axis) for axis in ("pp", "dp", "tp")},
            "inputs": batch["inputs"] if grid.coordinates(r)[0] == 0 else None,
            "targets": batch["targets"] if grid.coordinates(r)[0] == 1 else None,
        }
        for r in range(grid.world_size)
    ]
    judge = Judge(f"{grid} on {layout}, h={h}, ffn={ffn}, blocks per stage {blocks}, m={m}, {samples} samples, 1f1b, float32", reproduce)
    _, records = audited.run(judge, Layout(grid.world_size), "pipeline_parallel:mesh_step", per_rank)
    itemsize, sizes = 4, [len(c) for c in torch.tensor_split(torch.arange(samples), m)]
    by_axis = audit.bytes_by_axis(records, layout, axes, phase=("pipeline", "data_parallel"))
    request.node.user_properties.append(("bytes_by_link", json.dumps(by_axis)))
    request.node.user_properties.append(("link_report", f"{grid} on {layout}: {audit.link_report(by_axis)}"))
    violations = audit.groups_within_hosts(axes["tp"], layout, "tensor-parallel")
    for rank, totals in by_axis.items():
        s, _, _ = grid.coordinates(rank)
        stage = [cost_model.pipeline_stage(grid.pp, s, 1, size * h * itemsize) for size in sizes]
        messages = sum((part["forward"] > 0) + (part["backward"] > 0) for part in stage)
        pp_bound = sum(part["forward"] + part["backward"] for part in stage) + messages * PIPELINE_METADATA_BYTES
        if totals["tp"][ACROSS]:
            violations.append(f"rank {rank}: {totals['tp'][ACROSS]} B of tensor-parallel traffic crossed hosts")
        pipeline = totals["pp"][WITHIN] + totals["pp"][ACROSS]
        if pipeline > pp_bound:
            violations.append(
                f"rank {rank}: {pipeline} B along its pipeline group, more than one activation forward and "
                f"one gradient backward per microbatch ({pp_bound} B with {messages} x "
                f"{PIPELINE_METADATA_BYTES} B of metadata)"
            )
        stray = totals["other"][WITHIN] + totals["other"][ACROSS] + totals["dp"][WITHIN] + totals["dp"][ACROSS]
        if stray:
            violations.append(
                f"rank {rank}: {stray} B sent along no axis that needs it (data-parallel groups of one, or "
                f"ranks outside its tensor-parallel and pipeline groups)"
            )
    check(judge, violations)
