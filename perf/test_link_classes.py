"""Bytes per mesh axis and link class, per strategy and per placement (issue 15; the lecture's rule:
"frequent communication stays on fast links; infrequent communication crosses slower ones").

Three two-dimensional meshes of 4 ranks run one step of the bundled implementation in an audited
world (every call recorded): DP x TP (the composition program), TP x PP and DP x PP (the mesh
program), the same MLP blocks (h=64, ffn=256, float32), with 8 and with 512 samples per replica.
Every recorded byte
is charged to the mesh axis it travels along and to the link it crosses (harness.driver.audit,
``bytes_by_axis``) on 2 hosts of 2 ranks, placed two ways side by side from the same records:
blocked (rank r on host r // 2, Megatron-LM's order with tensor parallelism innermost) and
round-robin (host r % 2). Printed: the table per strategy, axis and link; recorded: the bytes that
cross hosts under each placement and their ratio. Goal: the blocked placement sends no
tensor-parallel byte across hosts and, at 512 samples per replica, for every strategy with tensor
parallelism, fewer bytes across hosts than round-robin.

Measured (first run): with 8 samples per replica, DP x TP on the blocked placement sends 16x MORE
bytes across hosts than round-robin: the gradient all-reduce (2 h ffn / tp elements per rank)
outweighs tensor parallelism's activations (tokens x h per pass) when there are fewer tokens than
ffn / tp. The lecture's rule is about frequency (TP talks in every layer's forward and backward, on
the critical path; DP once per step, overlappable); in bytes it holds once tokens per step exceed
ffn / tp, as they do in training. Both workloads are recorded.
"""

from __future__ import annotations

import pytest
import torch

from parallelism_conformance.harness.driver import audit
from parallelism_conformance.harness.driver.pool import WorldPool
from parallelism_conformance.harness.rank import pipeline_models
from parallelism_conformance.reference.mesh import Mesh
from parallelism_conformance.reference.topology import ACROSS, WITHIN, HostLayout

H, FFN, M = 64, 256, 2
WORKLOADS = (8, 512)  # samples per replica; the gate is on the second
MESH_STEP = "parallelism_conformance.harness.rank.programs.pipeline_parallel:mesh_step"
DP_TP = "parallelism_conformance.harness.rank.programs.composition:dp_tp_mlp"
PLACEMENTS = {"blocked": HostLayout(2, 2), "round-robin": HostLayout(2, 2, round_robin=True)}


def _mesh_args(grid: Mesh, samples: int) -> list[dict]:
    model = {"h": H, "ffn": FFN, "blocks": grid.pp, "bias": True, "dtype": "float32"}
    batch = pipeline_models.make_block_batch(model, samples * grid.dp, seed=0)
    rows = [torch.tensor_split(batch[k], grid.dp) for k in ("inputs", "targets")]
    args = []
    for rank in range(grid.world_size):
        s, d, _ = grid.coordinates(rank)
        args.append(
            {
                "model": model,
                "seed": 0,
                "blocks_per_stage": [1] * grid.pp,
                "num_microbatches": M,
                "loss": "mse",
                "schedule": "1f1b",
                "mesh": {a: grid.groups(a) for a in ("pp", "dp", "tp")},
                "inputs": rows[0][d] if s == 0 else None,
                "targets": rows[1][d] if s == grid.pp - 1 else None,
                "group": None,
            }
        )
    return args


def _dp_tp_args(grid: Mesh, samples: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    dense = {
        "fc1_weight": torch.randn(FFN, H, generator=generator) / H**0.5,
        "fc1_bias": torch.zeros(FFN),
        "fc2_weight": torch.randn(H, FFN, generator=generator) / FFN**0.5,
        "fc2_bias": torch.zeros(H),
    }
    x = torch.randn(grid.dp * samples, H, generator=generator)
    g = torch.randn(grid.dp * samples, H, generator=generator)
    return [
        {
            "tensor_parallel_groups": grid.groups("tp"),
            "data_parallel_groups": grid.groups("dp"),
            "dense": dense,
            "x": x.chunk(grid.dp)[grid.coordinates(r)[1]].contiguous(),
            "grad_output": g.chunk(grid.dp)[grid.coordinates(r)[1]].contiguous(),
            "group": None,
        }
        for r in range(grid.world_size)
    ]


STRATEGIES = {
    "DP x TP (dp=2, tp=2)": (Mesh(1, 2, 2), DP_TP, _dp_tp_args),
    "TP x PP (pp=2, tp=2)": (Mesh(2, 1, 2), MESH_STEP, _mesh_args),
    "DP x PP (pp=2, dp=2)": (Mesh(2, 2, 1), MESH_STEP, _mesh_args),
}


@pytest.mark.parametrize("samples", WORKLOADS)
def test_bytes_per_axis_and_link_class_by_placement(figures, samples):
    by_strategy = {}
    with WorldPool("gloo", audit=True) as pool:
        for name, (grid, program, make_args) in STRATEGIES.items():
            result = pool.run(grid.world_size, program, make_args(grid, samples), impl="parallelism_conformance.impls")
            records = dict(enumerate(result.records))
            axes = {axis: grid.groups(axis) for axis in ("tp", "pp", "dp")}
            phases = ("forward", "backward", "pipeline", "data_parallel")
            by_strategy[name] = {
                placement: audit.bytes_by_axis(records, layout, axes, phase=phases) for placement, layout in PLACEMENTS.items()
            }
    print(
        f"\nbytes sent in one step, summed over the 4 ranks, on 2 hosts x 2 ranks (bundled implementation; h={H}, "
        f"ffn={FFN}, {samples} samples per replica, m={M}, float32)"
    )
    print(f"{'strategy':<22} {'placement':<12} {'axis':<5} {WITHIN:>15} {ACROSS:>13}")
    failures = []
    for name, placements in by_strategy.items():
        across = {}
        for placement, by_axis in placements.items():
            for axis in ("tp", "pp", "dp", "other"):
                within = sum(r[axis][WITHIN] for r in by_axis.values())
                crossing = sum(r[axis][ACROSS] for r in by_axis.values())
                if within or crossing:
                    print(f"{name:<22} {placement:<12} {axis:<5} {within:>13} B {crossing:>11} B")
            across[placement] = sum(r[a][ACROSS] for r in by_axis.values() for a in r)
            tp_across = sum(r["tp"][ACROSS] for r in by_axis.values())
            if placement == "blocked" and tp_across:
                failures.append(f"{name}: {tp_across} B of tensor-parallel traffic cross hosts under the blocked placement")
        has_tp = "TP" in name
        gated = has_tp and samples == WORKLOADS[-1]
        ratio = across["round-robin"] / across["blocked"] if across["blocked"] else float("inf")
        met = (across["blocked"] < across["round-robin"]) if gated else None
        if gated and not met:
            failures.append(f"{name}: blocked sends {across['blocked']} B across hosts, round-robin {across['round-robin']} B")
        figures.record(
            f"bytes across hosts, round-robin placement against blocked, {name}, {samples} samples per replica",
            f"{ratio:.2f}x ({across['round-robin']} B against {across['blocked']} B per step)",
            "> 1x and no TP byte across hosts when blocked" if gated else "",
            met,
        )
    assert not failures, "; ".join(failures)
