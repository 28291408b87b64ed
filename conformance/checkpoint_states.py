"""Judging the states a checkpoint test's ranks report (conformance/test_checkpoint_reshard.py): the
names of the layouts that are not plain data parallelism and where tensor parallelism cuts the model,
``full_states`` (a layout's per-rank tensors put together into full states), and the checks of the
states, refusals, random streams and the load with a file missing against what was saved."""

from __future__ import annotations

import torch

import parallelism_conformance.reference.data_parallel as ref
from parallelism_conformance.conformance.verdict import Judge, check_names
from parallelism_conformance.harness.rank import models

TENSOR_PARALLEL = "tensor_parallel"
PIPELINE = "pipeline"  # a pp x dp mesh of the stacked_mlp model's stages
# the gelu_mlp model under tensor parallelism: the dimension each shard was cut along (the column
# layer's weight and bias rows, the row layer's weight columns); its other tensors are whole
TP_CUTS = {"mlp.fc1.weight": 0, "mlp.fc1.bias": 0, "mlp.fc2.weight": 1}


def full_states(judge: Judge, per_rank: list[dict], layout: str, who: str, mesh: dict | None) -> dict[str, dict]:
    """{whose: full state}: each rank's own under data parallelism; under tensor parallelism one, put
    together in the driver from the ranks' local tensors (the whole ones bitwise alike on every rank);
    on a pp x dp mesh one, every stage's tensors (bitwise alike on its replicas)."""
    if layout == PIPELINE:
        full = {}
        for s in range(mesh["pp"]):
            holders = [s * mesh["dp"] + d for d in range(mesh["dp"])]
            for name in per_rank[holders[0]]:
                judge.bitwise_identical(
                    {r: per_rank[r].get(name, torch.empty(0)) for r in holders}, what=f"{who}: stage {s}'s '{name}' on its replicas"
                )
                full[name] = per_rank[holders[0]][name]
        return {f"{who} (its stages put together)": full}
    if layout != TENSOR_PARALLEL:
        return {f"{who}'s rank {r}": state for r, state in enumerate(per_rank)}
    for r, state in enumerate(per_rank):
        if not isinstance(state, dict) or set(state) != set(per_rank[0]):
            judge.fail(
                f"{who}'s rank {r} reports tensors {sorted(state) if isinstance(state, dict) else state!r}, rank 0 {sorted(per_rank[0])}"
            )
    full = {}
    for name in per_rank[0]:
        if name in TP_CUTS:
            full[name] = torch.cat([state[name] for state in per_rank], dim=TP_CUTS[name])
        else:
            judge.bitwise_identical(
                {r: state[name] for r, state in enumerate(per_rank)}, what=f"{who}: '{name}', whole on every tensor-parallel rank"
            )
            full[name] = per_rank[0][name]
    return {f"{who} (its tensor-parallel shards put together)": full}


def exact_names(model: dict) -> set[str]:
    """Frozen parameters and buffers: training leaves them bitwise as they were."""
    net = models.build(model, 0)
    return {name for name, p in net.named_parameters() if not p.requires_grad} | {n for n, _ in net.named_buffers()}


def check_state(judge: Judge, got: dict, expected: ref.Trajectory, step: int, exact: set[str], who: str) -> None:
    want = expected.states[step - 1]
    check_names(judge, got, want, f"{who}: full parameters and buffers")
    for name, value in want.items():
        judge.tensor(
            got[name],
            value,
            atol=None if name in exact else ref.param_atol(expected, step, name),
            what=f"{who}: '{name}' (one process on the global batch)",
        )


def check_refused(judge: Judge, outcomes: list[dict], what: str) -> None:
    loaded = [r for r, outcome in enumerate(outcomes) if "raised" not in outcome]
    if loaded:
        raised = {r: o["raised"] for r, o in enumerate(outcomes) if "raised" in o}
        judge.fail(
            f"{what}: rank(s) {loaded} loaded it without an error (a checkpoint of another architecture must "
            f"be refused on every rank)" + (f"; the others raised {raised}" if raised else "")
        )


def check_streams(judge: Judge, saved: list, resumed: list) -> None:
    """Rank r's generator after the load is in the state rank r's was in when it saved."""
    for r, state in enumerate(resumed):
        if torch.equal(state, saved[r]):
            continue
        others = [q for q, before in enumerate(saved) if torch.equal(state, before)]
        whose = f"rank {others[0]}'s stream (Megatron-LM#6858)" if others else "a stream no rank saved (not restored)"
        judge.fail(
            f"rank {r}'s default random generator after load_checkpoint holds {whose}, not the one rank {r} "
            "had when it saved: a resumed run draws other dropout masks and data orders"
        )


def check_missing_file(judge: Judge, outcomes: list[dict], want: dict, dropped: str, layout: str, mesh: dict | None) -> None:
    """All ranks raised, or all loaded exactly what was saved."""
    raised = [r for r, outcome in enumerate(outcomes) if "raised" in outcome]
    if raised and len(raised) != len(outcomes):
        judge.fail(f"without the file {dropped!r}, rank(s) {raised} raised and the others loaded: a refusal must come from every rank")
    if raised:
        return
    for who, got in full_states(judge, [outcome["loaded"] for outcome in outcomes], layout, "world B", mesh).items():
        check_names(judge, got, want, f"{who} after loading the checkpoint without {dropped!r}")
        for name, value in want.items():
            judge.tensor(
                got[name],
                value,
                what=f"{who}: '{name}' loaded from the checkpoint without the file "
                f"{dropped!r} (it must be refused, or load exactly what was saved)",
            )
