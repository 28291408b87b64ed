"""The communication audit of gradient clipping (the rules: harness/driver/audit.py; the bounds:
reference/cost_model.py): the global norm needs each rank's partial sums, never the gradients."""

from __future__ import annotations

import math

import pytest

from parallelism_conformance.conformance.audit.common import DP_MODELS, audits, check
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.driver import audit
from parallelism_conformance.harness.rank import models
from parallelism_conformance.reference import cost_model

pytestmark = pytest.mark.capability("audit")

SCALAR_BYTES = 8  # a partial sum in float64, the widest a rank needs


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("layout", ["fully_sharded", "data_parallel"])
@pytest.mark.parametrize("n", [2, 4])
def test_clipping_reduces_scalars_only(n, layout, norm_type, audited, request, reproduce):
    """clip_grad_norm_ on a fully sharded module all-reduces partial sums, at most one scalar per
    parameter (one in all suffices); on a data-parallel module, whose gradients are whole and
    averaged on every rank, it sends nothing. Gathering gradients to take their norm sends far
    more."""
    audits(request, "grad_clipping")
    if n > audited.target.max_world_size:
        pytest.skip(f"needs {n} ranks (--max-world-size {audited.target.max_world_size})")
    spec = DP_MODELS["tied_lm"][0]
    net = models.build(spec, 0)
    parameters = sum(1 for p in net.parameters() if p.requires_grad)
    batch = models.make_batch(spec, 2 * n, seed=1)
    slices = [{k: v[2 * r : 2 * r + 2] for k, v in batch.items()} for r in range(n)]
    clip = {"max_norm": 0.1, "norm_type": norm_type}
    judge = Judge(f"world_size={n}, {layout}, model={spec}, norm_type={norm_type}", reproduce)
    if layout == "fully_sharded":
        optimizer = {"name": "sgd", "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0}
        per_rank = [{"model": spec, "seed": 0, "optimizer": optimizer, "batch": slices[r], "clip": clip} for r in range(n)]
        bound = cost_model.all_reduce(n, parameters, SCALAR_BYTES)
        what = f"a norm over {parameters} sharded parameters (at most one {SCALAR_BYTES}-byte partial sum each)"
    else:
        per_rank = [{"model": spec, "seed": 0, "frozen": [], "batch": slices[r], "bucket_size_mb": None, "clip": clip} for r in range(n)]
        bound, what = 0, "a norm of gradients every rank holds whole"
    _, records = audited.run(judge, Layout(n), f"audit:{layout}_step", per_rank)
    check(judge, audit.within_bound(records, {r: bound for r in range(n)}, what, phase="clip"))
