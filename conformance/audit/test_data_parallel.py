"""The communication audit of data parallel (the rules: harness/driver/audit.py; the bounds:
reference/cost_model.py)."""

from __future__ import annotations

import pytest

from parallelism_conformance.conformance.audit.common import DP_MODELS, audits, check
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.driver import audit
from parallelism_conformance.harness.rank import models
from parallelism_conformance.reference import cost_model

pytestmark = pytest.mark.capability("audit")


STEP = ("backward", "last_gradient", "finish")  # the phases of a data-parallel step (harness/rank/programs/audit.py)


@pytest.mark.parametrize("bucket_size_mb", [None, 256 / 2**20], ids=["default_buckets", "256B_buckets"])
@pytest.mark.parametrize("model_name", list(DP_MODELS))
@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_step(n, model_name, bucket_size_mb, audited, request, reproduce):
    """One step all-reduces the trainable gradients once: per rank at most
    cost_model.data_parallel_step, and backend reductions add up to exactly their bytes. With
    bucket_size_mb given: no backend reduction exceeds the cap unless it is one oversized
    parameter, and some communication starts before backward ends (overlap)."""
    audits(request, "data_parallel")
    if n > audited.target.max_world_size:
        pytest.skip(f"needs {n} ranks (--max-world-size {audited.target.max_world_size})")
    spec, frozen = DP_MODELS[model_name]
    net = models.build(spec, 0)
    for name, p in net.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    trainable = [p for p in net.parameters() if p.requires_grad]  # tied weights once
    frozen_names = [name for name, p in net.named_parameters() if not p.requires_grad]
    numels = [p.numel() for p in trainable]
    itemsize = trainable[0].element_size()
    gradient_bytes = cost_model.data_parallel_reduced_bytes(models.trainable_bytes(net))
    batch = models.make_batch(spec, 2 * n, seed=1)
    slices = [{k: v[2 * r : 2 * r + 2] for k, v in batch.items()} for r in range(n)]
    layout = Layout(n)
    judge = Judge(f"world_size={n}, model={model_name} ({spec}, frozen {frozen}), bucket_size_mb={bucket_size_mb}", reproduce)
    _, records = audited.run(
        judge,
        layout,
        "audit:data_parallel_step",
        [{"model": spec, "seed": 0, "frozen": frozen, "batch": slices[r], "bucket_size_mb": bucket_size_mb} for r in range(n)],
    )
    bound = cost_model.data_parallel_step(n, numels, itemsize)
    # Allowed on top, for torch's DDP as the suite configures it (adapters/torch_native.py): the
    # buffers broadcast at every forward (broadcast_buffers=True) and one int32 flag per parameter
    # all-reduced to find unused parameters (find_unused_parameters=True).
    buffers = [b for b in net.buffers()]
    ddp_extra = sum(cost_model.broadcast(n, b.numel(), b.element_size()) for b in buffers) + cost_model.all_reduce(
        n, len(list(net.parameters())), 4
    )
    uses_backend = any(r["op"] not in ("send", "recv", "recv_anysource") for rs in records.values() for r in rs if r.get("phase") in STEP)
    if uses_backend:
        bound += ddp_extra
    what = (
        f"one data-parallel step: one all-reduce of {sum(numels)} trainable items in {len(numels)} tensors "
        f"({gradient_bytes} B; frozen {', '.join(frozen_names) or 'none'} excluded): "
        f"floor(2(n-1)(G_items + P)/n) itemsize" + (" + DDP's buffer broadcast and unused-parameter flags" if uses_backend else "")
    )
    violations = audit.within_bound(records, {r: bound for r in range(n)}, what, phase=STEP)
    violations += audit.reduced_once(records, gradient_bytes, "the trainable gradients", phase=STEP)
    if bucket_size_mb is not None:
        cap = round(bucket_size_mb * 2**20)
        violations += audit.buckets_within_cap(records, cap, [p.numel() * p.element_size() for p in trainable])
        violations += audit.starts_during_backward(
            records,
            f"with bucket_size_mb={bucket_size_mb:.9g} ({cap} B) the "
            "contract's bucketed DDP reduces each bucket as soon as it is full, "
            "while backward goes on (CONTRACT.md)",
        )
    check(judge, violations)
