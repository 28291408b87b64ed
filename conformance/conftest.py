"""The ``backend_refusals`` fixture: what the backend's own collectives refuse, probed once per
backend of the plan with torch.distributed's functions called as conformance/collective_table.py
says, so a case the backend itself cannot run is not drawn (the message names the backend)."""

from __future__ import annotations

import pytest
import torch

from parallelism_conformance.conformance.collective_table import TABLE, Case
from parallelism_conformance.harness.driver.failures import TASK_FAILURES
from parallelism_conformance.harness.driver.plugin.refusals import BackendRefusals
from parallelism_conformance.reference.collectives import DTYPES, OPS, op_applies

# The probe runs the backend's own collectives, not the code under test, so --rank-timeout (sized
# for the implementation's tasks, 2 s in some of the project's own tests) is not its deadline: on a
# loaded two-core machine its few hundred calls took longer than that.
PROBE_TIMEOUT_S = 120.0

REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
# all_to_all_uneven: all_to_all where member i sends i + 1 elements to every member
OTHERS = ("broadcast", "scatter", "gather", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_uneven", "all_to_all_single")


def probe_cases() -> list[tuple[str, str, str | None]]:
    """(collective, dtype name, op name or None): every dtype and applicable op of every collective."""
    cases = [(c, str(d).removeprefix("torch."), op) for c in REDUCTIONS for d in DTYPES for op in OPS if op_applies(op, d)]
    return cases + [(c, str(d).removeprefix("torch."), None) for c in OTHERS for d in DTYPES]


def probe_calls(cases: list[tuple[str, str, str | None]], n: int) -> list[list[tuple[tuple, str, dict]]]:
    """Each member's (case, function, keyword arguments) for the probe program, on tiny tensors."""
    calls: list[list[tuple[tuple, str, dict]]] = [[] for _ in range(n)]
    for case in cases:
        collective, dtype_name, op = case
        uneven = collective.endswith("_uneven")
        entry = TABLE[collective.removesuffix("_uneven")]
        inputs = [torch.ones(((i + 1) * n if uneven else n,), dtype=getattr(torch, dtype_name)) for i in range(n)]
        for member, arguments in enumerate(entry.call(inputs, Case(op=op))):
            calls[member].append((case, entry.name, arguments))
    return calls


@pytest.fixture(scope="session")
def backend_refusals(world_pool, target) -> BackendRefusals:
    return probe_refusals(world_pool, target.plan)


def probe_refusals(world_pool, plan) -> BackendRefusals:
    """Probed on each backend of the plan, at its smallest world of two ranks or more (else its
    one world), in a world started for the probe; a case any of them refuses is not drawn."""
    cases = probe_cases()
    refused, refusing = {}, []
    for backend in plan.backends():
        sizes = plan.sizes(backend)
        n = next((size for size in sizes if size >= 2), sizes[0])
        calls = probe_calls(cases, n)
        # A fresh world: ranks that ran the implementation could have replaced this probe's rank
        # program (whatever runs in a rank it can rewrite), and then chosen which tests skip.
        # Ranks forked anew from the forkserver never imported it (the world's old ones are swept).
        world_pool.close_world(n)
        try:
            probe = world_pool.run(
                n,
                "parallelism_conformance.harness.rank.programs.probe:native_refusals",
                [{"calls": c} for c in calls],
                impl="torch.distributed",
                timeout_s=max(PROBE_TIMEOUT_S, world_pool.timeout_s),
            )
        except TASK_FAILURES as failure:
            # an Exception, not the task's BaseException: pytest caches a session fixture's error
            # only when it is an Exception (a BaseException here broke its fixture bookkeeping, and
            # every later test errored with a bare AssertionError from inside pytest)
            raise RuntimeError(
                f"the probe of {backend}'s own collectives on {n} ranks (torch.distributed's, "
                f"not the implementation's) did not finish: {failure}"
            ) from None
        found = {case: f"{backend}: {message}" for case, message in probe.outputs[0].items() if message is not None}
        refusing += [backend] if found else []
        refused = {**found, **refused}
    return BackendRefusals(" and ".join(refusing) or "/".join(plan.backends()), refused)
