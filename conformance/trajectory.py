"""Judging the state the ranks hold after each optimizer step against one process's trajectory
(reference/data_parallel.py ``Trajectory``), shared by the tests that train a few steps."""

from __future__ import annotations

import parallelism_conformance.reference.data_parallel as ref
from parallelism_conformance.conformance.verdict import Judge, check_names


def check_state_after_step(judge: Judge, rank: int, state: dict, expected: ref.Trajectory, step: int, exact, why: str) -> None:
    """Rank ``rank``'s parameters and buffers after step ``step`` (0-based) against the trajectory's:
    names exactly, the ``exact`` ones (frozen parameters, buffers: a set, or a dict naming their kind)
    bitwise, the others within ``reference.data_parallel.param_atol``; ``why`` says what one process
    did."""
    after = f"step {step + 1}"
    check_names(judge, state, expected.states[step], f"rank {rank} after {after}: parameters and buffers")
    kinds = exact if isinstance(exact, dict) else {name: "" for name in exact}
    for name, want in expected.states[step].items():
        kind = kinds.get(name, "parameter") or "parameter"
        judge.tensor(
            state[name],
            want,
            atol=None if name in kinds else ref.param_atol(expected, step + 1, name),
            what=f"rank {rank} {kind} '{name}' after {after} ({why})",
        )
