"""The communication audit of tensor parallel (the rules: harness/driver/audit.py; the bounds:
reference/cost_model.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parallelism_conformance.conformance.audit.common import audits, check
from parallelism_conformance.conformance.examples import layouts
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.driver import audit
from parallelism_conformance.reference import cost_model

pytestmark = pytest.mark.capability("audit")


@pytest.mark.parametrize("layer", ["mlp", "mlp_sp", "column"])
@given(data=st.data())
def test_tensor_parallel_traffic(layer, data, audited, request, reproduce):
    """MLP: one all-reduce of the activation forward and one backward, no all-gather of the hidden
    activation. Sequence-parallel MLP (Korthikanti et al. 2022, sec. 4.2.2: "the same communication
    volume"): an all-gather and a reduce-scatter per pass, together one all-reduce's bytes. Column
    layer without gather_output: nothing forward, one all-reduce of dL/dx backward."""
    audits(request, "tensor_parallel")
    layout = data.draw(layouts(audited.target.max_world_size, min_size=2), label="layout")
    if layout.size < 2:
        pytest.skip("needs a group of at least 2 ranks (--max-world-size)")
    n = layout.size
    h = data.draw(st.integers(1, 12), label="h")
    f = n * data.draw(st.integers(1, 6), label="ffn per rank")
    leading = tuple(data.draw(st.lists(st.integers(1, 3), max_size=2), label="leading dims"))
    if layer == "mlp_sp":  # [..., seq, h] with the sequence (dim -2) split in n
        leading = (*leading[:1], n * data.draw(st.integers(1, 3), label="sequence per rank"))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    g = torch.Generator().manual_seed(seed)
    normal = lambda *shape: torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    dense = {"fc1_weight": normal(f, h), "fc1_bias": normal(f), "fc2_weight": normal(h, f), "fc2_bias": normal(h)}
    x = normal(*leading, h)
    itemsize = x.element_size()
    rows = x.numel() // h
    inputs = [x] * n
    if layer == "mlp":
        grads = [normal(*leading, h)] * n
        budget = cost_model.tensor_parallel_mlp(n, x.numel(), itemsize)
        what = f"the tensor-parallel MLP (h={h}, ffn={f}) on {n} ranks, activation {tuple(x.shape)}: one all-reduce"
    elif layer == "mlp_sp":
        grads = list(normal(*leading, h).chunk(n, dim=-2))
        inputs = list(x.chunk(n, dim=-2))
        budget = cost_model.sequence_parallel_mlp(n, x.numel(), h, itemsize)
        what = (
            f"the sequence-parallel MLP (h={h}, ffn={f}) on {n} ranks, activation {tuple(x.shape)} in sequence "
            f"shards: an all-gather and a reduce-scatter per pass, and backward the all-reduce of dL/db2"
        )
    else:
        full_grad = normal(*leading, f)
        grads = list(full_grad.chunk(n, dim=-1))
        budget = cost_model.column_parallel(n, x.numel(), itemsize)
        what = f"the column-parallel linear ({h} -> {f}, gather_output=False) on {n} ranks, input {tuple(x.shape)}"
    judge = Judge(f"{layout}, {layer}, h={h}, ffn={f}, leading={leading}, {dtype}, seed={seed}", reproduce)
    _, records = audited.run(
        judge,
        layout,
        "audit:tensor_parallel",
        [{"layer": layer, "dense": dense, "x": inputs[i].contiguous(), "grad_output": grads[i].contiguous()} for i in range(n)],
    )
    violations = []
    for phase in ("forward", "backward"):
        bounds = {r: budget[phase] for r in layout.ranks}
        violations += audit.within_bound(records, bounds, f"{what} ({phase}: {budget[phase]} B)", phase=phase)
    if layer != "mlp_sp":  # sequence parallelism all-gathers x by design, which may be the hidden's size
        hidden = rows * f * itemsize
        violations += audit.no_full_all_gather(records, hidden, f"hidden activation [{rows} rows, {f}]")
    check(judge, violations)
