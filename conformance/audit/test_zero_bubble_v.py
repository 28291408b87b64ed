"""The communication audit of zero bubble v (the rules: harness/driver/audit.py; the bounds:
reference/cost_model.py)."""

from __future__ import annotations

import pytest

from parallelism_conformance.conformance.audit.common import PIPELINE_METADATA_BYTES, audits, check
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.driver import audit
from parallelism_conformance.reference import cost_model

pytestmark = pytest.mark.capability("audit")


@pytest.mark.parametrize("p", [2, 3])
def test_pipeline_traffic_on_the_v(p, audited, request, reproduce):
    """ZB-V on the V placement (capability zero_bubble_v), p ranks, m = 2p - 1 equal microbatches of
    a float32 stack of Linear+Tanh layers of width h: each stage sends one activation forward per
    microbatch unless the next stage is on its own rank (the last stage, and the turn of the V,
    stage p - 1 to p on rank p - 1) and one gradient backward unless the previous stage is on its
    own rank (cost_model.pipeline_stage), plus PIPELINE_METADATA_BYTES per message; only to its
    neighbours on the V, ranks r - 1 and r + 1; and no collective beyond PIPELINE_METADATA_BYTES of
    metadata (torch's pipelining adapter broadcasts the batch size)."""
    from parallelism_conformance.harness.rank import pipeline_models
    from parallelism_conformance.reference.pipeline_schedules import V_SHAPE, stage_rank

    audits(request, "zero_bubble_v")
    if audited.target.max_world_size < p:
        pytest.skip(f"needs {p} ranks (--max-world-size)")
    h, m, itemsize, samples_per_microbatch = 8, 2 * p - 1, 4, 2
    model = {"widths": [h] * (2 * p + 1), "dtype": "float32"}
    batch = pipeline_models.make_batch(model, m * samples_per_microbatch, seed=5)
    common = {
        "model": model,
        "seed": 5,
        "layers_per_stage": [1] * (2 * p),
        "stages_per_rank": 2,
        "num_microbatches": m,
        "loss": "mse",
        "schedule": "zb-v",
        "placement": V_SHAPE,
    }
    per_rank = [{**common, "inputs": batch["inputs"] if r == 0 else None, "targets": batch["targets"] if r == 0 else None} for r in range(p)]
    judge = Judge(f"zb-v on p={p} ranks, m={m}, width {h}, {samples_per_microbatch} samples per microbatch, float32", reproduce)
    _, records = audited.run(judge, Layout(p), "pipeline_parallel:train_step", per_rank)
    activation = samples_per_microbatch * h * itemsize
    violations = []
    for rank in range(p):
        bound = messages = 0
        for s in (rank, 2 * p - 1 - rank):
            part = cost_model.pipeline_stage(2 * p, s, m, activation)
            if part["forward"] and stage_rank(s + 1, p, V_SHAPE) != rank:
                bound, messages = bound + part["forward"], messages + m
            if part["backward"] and stage_rank(s - 1, p, V_SHAPE) != rank:
                bound, messages = bound + part["backward"], messages + m
        bound += messages * PIPELINE_METADATA_BYTES
        sent = sum(audit.charged_bytes(r) for r in records[rank] if r["op"] == "send")
        strays = sorted({r["peer"] for r in records[rank] if r["op"] == "send"} - {rank - 1, rank + 1})
        other = sum(audit.charged_bytes(r) for r in records[rank] if r["op"] != "send")
        if sent > bound:
            violations.append(
                f"rank {rank}: {sent} B sent point to point, more than one activation forward and one "
                f"gradient backward per microbatch across each boundary between ranks ({bound} B with "
                f"{messages} x {PIPELINE_METADATA_BYTES} B of metadata; the turn of the V on rank "
                f"{p - 1} is local)"
            )
        if strays:
            violations.append(f"rank {rank}: sent to ranks {strays}, which are not its neighbours on the V")
        if other > PIPELINE_METADATA_BYTES:  # e.g. the batch size, which only rank 0 knows
            violations.append(
                f"rank {rank}: {other} B in collectives; a pipeline step needs point to point only, "
                f"and at most {PIPELINE_METADATA_BYTES} B of metadata"
            )
    check(judge, violations)
