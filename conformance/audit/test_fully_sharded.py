"""The communication audit of fully sharded (the rules: harness/driver/audit.py; the bounds:
reference/cost_model.py)."""

from __future__ import annotations

import pytest
import torch

from parallelism_conformance.conformance.audit.common import DP_MODELS, audits, check
from parallelism_conformance.conformance.examples import Layout, handout_fsdp_model
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.driver import audit
from parallelism_conformance.harness.rank import models
from parallelism_conformance.reference import cost_model

pytestmark = pytest.mark.capability("audit")


# four units, no root parameter: a rank that keeps every unit's weights from forward to backward
# holds more than the last unit and the prefetch window; activations (4 rows) never take a weight's shape
RELU_LM = {"kind": "relu_lm", "vocab": 12, "width": 8, "hidden": 16, "context": 2}
VECTORS = "the one-dimensional parameters: biases, gains, scales, which a CS336 FSDP replicates"


def vectors(net) -> int:
    """Elements of the trainable one-dimensional parameters (a CS336 FSDP shards the weights of
    Linear and Embedding layers and may all-reduce the gradients of the rest)."""
    return sum(p.numel() for p in net.parameters() if p.requires_grad and p.dim() <= 1)


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["zero3", "zero2"])
@pytest.mark.parametrize("model_name", ["mlp", "tied_lm", "relu_lm"])
@pytest.mark.parametrize("n", [2, 4])
def test_fully_sharded_step(n, model_name, reshard_after_forward, audited, request, reproduce):
    """One forward and backward gathers each unit's parameters at most twice (once with
    ``reshard_after_forward=False``: ZeRO-2's traffic, a unit keeps what it gathered for forward
    until backward) and reduce-scatters their gradients once (cost_model.fully_sharded_step); no
    backend all-reduce carries more than the one-dimensional parameters (which a CS336 FSDP
    replicates); the optimizer's step sends nothing. Under --scope cs336 the models are the handout's
    (conformance.examples.handout_fsdp_model)."""
    from parallelism_conformance.harness.rank.programs.fully_sharded import units

    audits(request, "fully_sharded" if reshard_after_forward else "zero2")
    if n > audited.target.max_world_size:
        pytest.skip(f"needs {n} ranks (--max-world-size {audited.target.max_world_size})")
    spec = {"mlp": {"kind": "mlp", "inputs": 24, "hidden": 32, "outputs": 3}, "tied_lm": DP_MODELS["tied_lm"][0], "relu_lm": RELU_LM}[
        model_name
    ]
    if audited.target.scope == "cs336":  # the handout's models: untied, rows that divide by n
        spec = handout_fsdp_model(spec, n)
    net = models.build(spec, 0)

    def sizes(params, trainable: bool) -> list[tuple[int, int]]:
        return [(p.numel(), p.shape[0] if p.dim() else 1) for p in params if p.requires_grad == trainable]

    held = {id(p) for u in units(net) for p in u.parameters()}
    root = [p for p in net.parameters() if id(p) not in held]
    in_units = [sizes(u.parameters(), True) for u in units(net)]
    frozen = [sizes(u.parameters(), False) for u in units(net)] + [sizes(root, False)]
    itemsize = next(net.parameters()).element_size()
    gathers = 2 if reshard_after_forward else 1
    bound = cost_model.fully_sharded_step(n, in_units + [sizes(root, True)], itemsize, gathers=gathers, frozen_numels=frozen)
    batch = models.make_batch(spec, 2 * n, seed=1)
    slices = [{k: v[2 * r : 2 * r + 2] for k, v in batch.items()} for r in range(n)]
    optimizer = {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-3, "weight_decay": 0.0}
    judge = Judge(f"world_size={n}, model={model_name} ({spec}), optimizer=adamw, reshard_after_forward={reshard_after_forward}", reproduce)
    outputs, records = audited.run(
        judge,
        Layout(n),
        "audit:fully_sharded_step",
        [
            {"model": spec, "seed": 0, "optimizer": optimizer, "batch": slices[r], "reshard_after_forward": reshard_after_forward}
            for r in range(n)
        ],
    )
    what = (
        f"one fully sharded forward and backward: {len(in_units) + 1} units, each gathered at most "
        f"{'twice' if gathers == 2 else 'once (reshard_after_forward=False)'} and reduce-scattered once"
    )
    violations = audit.within_bound(records, {r: bound for r in range(n)}, what, phase="step")
    violations += audit.all_reduced_at_most(records, vectors(net), VECTORS, phase="step")
    violations += audit.within_bound(records, {r: 0 for r in range(n)}, "the optimizer's step (every state is local)", phase="optimizer")
    if reshard_after_forward:
        violations += kept_for_backward(outputs, net, n, itemsize)
    check(judge, violations)


PREFETCHED_UNITS = 1  # beside the unit run last: the next one gathered ahead (the CS336 handout's prefetch)


def kept_for_backward(outputs: dict, net, n: int, itemsize: int) -> list[str]:
    """Resharded after forward (ZeRO-3), a unit's weights are gathered again for backward: when
    forward ends, what the step's all-gathers and receives wrote and the rank still holds
    (harness.rank.recording.still_held) is at most the root's own parameters and PREFETCHED_UNITS + 1
    units' (the unit run last, needed first by backward, and one gathered ahead), the largest, each padded to a
    multiple of n. More means weights kept whole from forward to backward. A copy of the gathered
    weights made elsewhere is not seen; a rank reports this figure, as it does its memory."""
    from parallelism_conformance.harness.rank.programs.fully_sharded import units

    def padded(p) -> int:
        return cost_model.sharded_numel(n, p.numel(), p.shape[0] if p.dim() else 1)

    in_units = {id(p) for u in units(net) for p in u.parameters()}
    root = [p for p in net.parameters() if id(p) not in in_units]
    unit_numels = sorted((sum(padded(p) for p in u.parameters()) for u in units(net)), reverse=True)
    allowed = itemsize * (sum(padded(p) for p in root) + sum(unit_numels[: PREFETCHED_UNITS + 1]))
    return [
        f"rank {rank}: when forward ends it still holds {output['held_after_forward']} B of what its all-gathers "
        f"wrote, more than the root's own parameters and the {PREFETCHED_UNITS + 1} largest units' ({allowed} B): "
        f"resharded after forward, a unit's weights are gathered again for backward, not kept whole"
        for rank, output in sorted(outputs.items())
        if output["held_after_forward"] > allowed
    ]


@pytest.mark.parametrize("compute_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [2, 4])
def test_fully_sharded_step_gathers_in_the_compute_dtype(n, compute_dtype, audited, request, reproduce):
    """With ``compute_dtype`` the parameters are cast before they are gathered (the CS336 handout:
    "cast before communication"; FSDP2's ``param_dtype``): each unit's all-gathers are charged at
    the compute dtype's element size, its reduce-scatter at most at the masters' (in either dtype).
    Gathering float32 and casting after costs twice the gathers' bound, and a backend all-gather
    says its dtype."""
    from parallelism_conformance.harness.rank.programs.fully_sharded import units

    audits(request, "fsdp_compute_dtype")
    if n > audited.target.max_world_size:
        pytest.skip(f"needs {n} ranks (--max-world-size {audited.target.max_world_size})")
    spec = handout_fsdp_model(RELU_LM, n)
    net = models.build(spec, 0)
    unit_sizes = [[(p.numel(), p.shape[0]) for p in u.parameters()] for u in units(net)]
    compute = torch.empty((), dtype=getattr(torch, compute_dtype)).element_size()
    master = next(net.parameters()).element_size()
    bound = cost_model.fully_sharded_step(n, unit_sizes + [[]], compute, reduce_itemsize=master)
    batch = models.make_batch(spec, 2 * n, seed=1)
    slices = [{k: v[2 * r : 2 * r + 2] for k, v in batch.items()} for r in range(n)]
    optimizer = {"name": "sgd", "lr": 2.0**-3, "momentum": 0.5, "weight_decay": 0.0}
    judge = Judge(f"world_size={n}, model={spec}, compute_dtype={compute_dtype}", reproduce)
    outputs, records = audited.run(
        judge,
        Layout(n),
        "audit:fully_sharded_step",
        [{"model": spec, "seed": 0, "optimizer": optimizer, "batch": slices[r], "compute_dtype": compute_dtype} for r in range(n)],
    )
    what = (
        f"one fully sharded forward and backward in {compute_dtype}: {len(unit_sizes)} units, each gathered at "
        f"most twice in {compute_dtype} ({compute} B an element) and reduce-scattered once (at most {master} B)"
    )
    violations = audit.within_bound(records, {r: bound for r in range(n)}, what, phase="step")
    violations += audit.gathered_in(records, compute_dtype, "parameters (cast before communication)", phase="step")
    violations += audit.all_reduced_at_most(records, vectors(net), VECTORS, phase="step")
    violations += kept_for_backward(outputs, net, n, compute)
    violations += audit.within_bound(records, {r: 0 for r in range(n)}, "the optimizer's step (every state is local)", phase="optimizer")
    check(judge, violations)
