"""What the side-by-sides of loss-blind bugs share (tests/test_loss_blind_*.py): the training a
team's run does (``STEPS`` steps of AdamW at torch's default eps, whose update does not see a
gradient's scale), a mutant's path and the loss check a team's CI runs (their pool of ranks:
tests/conftest.py, ``training_pool``)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
ADAMW = {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


def impl_of(name: str) -> str:
    """``impls``, or the path of the mutant mutants/<name>.py."""
    return name if name == "parallelism_conformance.impls" else str(ROOT / "mutants" / f"{name}.py")


def worst_difference(ranks: list[float], single: list[float]) -> float:
    """The loss check: the largest relative difference between the ranks' loss curve and one process's."""
    return max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(ranks, single))
