"""The audit's transport allowances, measured: what the kernel counts a rank writing for one backend
collective beyond what its payload explains (harness/driver/audit.py: FIXED + ``payload_explained``),
per member of the group, against the audit's ``transport_allowance`` (PER_COLLECTIVE_PER_MEMBER, or
PER_MEMBER_BY_OP for a collective that writes more).

torch.distributed's own collectives run on an audited world with the arguments the audit's tests
draw (conformance/audit/collective_calls.py), every collective at every world size of
--perf-world-sizes from 2 (default up to 4), at sizes from one element to 5000, float32, SUM or MAX. The
allowances are estimates of a transport's overhead: a new torch version or backend measures its
own here before the audit's known-good runs can fail on it (torch 2.13's gloo reduce_scatter of a
list measured 1424 B per member at n=4, where the others stayed under 170 B). Goal: every
collective's worst case within its allowance.
"""

from __future__ import annotations

import random

import torch

from parallelism_conformance.conformance.audit.collective_calls import COLLECTIVES, collective_case
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.harness.driver import audit
from parallelism_conformance.harness.driver.pool import WorldPool
from parallelism_conformance.perf.conftest import world_sizes

CALL = "parallelism_conformance.harness.rank.programs.collectives:call"
SIZES = (1, 2, 3, 4, 7, 16, 64, 300, 1000, 5000)


def deterministic_draw(name: str, n: int, rng: random.Random, size: int):
    """The audit's ``draw(label, strategy)``, answered without Hypothesis: one size, float32."""

    def draw(label, strategy):
        if label == "op":
            return rng.choice(["SUM", "MAX"])
        if label == "dtype":
            return torch.float32
        if label == "seed":
            return rng.randint(0, 2**16)
        if label == "root":
            return rng.randrange(n)
        if label == "shape":
            return (size * n,) if name == "reduce_scatter_tensor" else (size,)
        if label == "input_split_sizes":
            return [[rng.randint(0, size) for _ in range(n)] for _ in range(n)]
        raise KeyError(f"no deterministic answer for {label!r}")

    return draw


def worst_overheads(sizes: list[int]) -> dict[str, tuple[float, int, int, float]]:
    """{collective: (worst bytes per member beyond the payload, at n, at size, allowed per member)}
    over every rank; the audit's own functions say what the payload explains and what is allowed."""
    rng = random.Random(0)
    worst: dict[str, tuple[float, int, int, float]] = {}
    with WorldPool("gloo", timeout_s=120, audit=True) as pool:
        for name in COLLECTIVES:
            for n in sizes:
                for size in SIZES:
                    _, args, _, _ = collective_case(name, deterministic_draw(name, n, rng, size), Layout(n))
                    result = pool.run(n, CALL, [{"function": name, "arguments": a, "group": None} for a in args], impl="torch.distributed")
                    for rank, records in enumerate(result.records):
                        written = result.bytes_written[rank]
                        collectives = [r for r in records if r["op"] not in audit.P2P_OPS and r["op"] not in audit.NEUTRAL_OPS]
                        if written is None or not collectives:
                            continue
                        members = sum(len(r["group"]) for r in collectives)
                        beyond = (written - audit.FIXED - sum(audit.payload_explained(r) for r in records)) / members
                        allowed = sum(audit.transport_allowance(r) for r in collectives) / members
                        if name not in worst or beyond > worst[name][0]:
                            worst[name] = (beyond, n, size, allowed)
    return worst


def test_every_collectives_transport_bytes_within_the_audits_allowance(figures, pytestconfig):
    sizes = [n for n in world_sizes(pytestconfig) if n >= 2]  # --perf-world-sizes
    worst = worst_overheads(sizes)
    over = []
    for name, (beyond, n, size, allowed) in sorted(worst.items(), key=lambda item: -item[1][0]):
        print(f"{name:24s} worst {beyond:7.0f} B per member beyond the payload (n={n}, {size} elements); allowed {allowed:.0f} B")
        if beyond > allowed:
            over.append(f"{name}: {beyond:.0f} B at n={n}, {size} elements, allowed {allowed:.0f} B")
    closest = max(worst, key=lambda name: worst[name][0] / worst[name][3])
    figures.record(
        f"audit: transport bytes per member beyond the charge, torch.distributed's collectives, n=2..{max(sizes)}",
        f"closest to its allowance: {closest} {worst[closest][0]:.0f} B (n={worst[closest][1]})",
        "every collective within its allowance",
        not over,
    )
    assert not over, "beyond the audit's transport allowance: " + "; ".join(over)
