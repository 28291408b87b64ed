"""Whether this session's ranks run contained (harness/rank/containment.py), decided once before
any rank starts, and what the coverage line says about it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from parallelism_conformance.harness.driver.plugin.profiles import current_profile
from parallelism_conformance.harness.rank import containment

CONTAINED = pytest.StashKey[bool]()


def contained(config) -> bool:
    """Whether ranks run contained, decided once by :func:`decide_containment`."""
    return config.stash.get(CONTAINED, False)


def decide_containment(config) -> bool:
    """Contain ranks under --contain-ranks yes, and under the grading profile unless told
    --contain-ranks no. Fails closed: where ranks cannot be contained (not root, or a probe rank
    that cannot drop every privilege or cannot then read what it must run), grading stops with the
    reason instead of running the submission with the driver's rights."""
    option = config.getoption("--contain-ranks")
    profile = getattr(config.option, "hypothesis_profile", None) or current_profile()
    if option == "no" or (option == "auto" and profile != "grading"):
        return False
    asked = "--contain-ranks yes" if option == "yes" else "the grading profile"
    if not containment.possible():
        raise pytest.UsageError(
            f"{asked} runs each world's ranks as a user of its own, which needs root, and this "
            "run is not root; pass --contain-ranks no to run the implementation with this "
            "user's rights (the report then says the ranks were not contained)"
        )
    reason = containment.probe(paths_a_rank_reads(config))
    if reason:
        raise pytest.UsageError(
            f"{asked}: ranks cannot be contained here: {reason}. Pass --contain-ranks no to run them uncontained (the report then says so)"
        )
    return True


def paths_a_rank_reads(config) -> list[str]:
    """What a contained rank must still read: its Python's standard library and torch, the suite's
    rank code, and the implementation file under test (a module name is found on sys.path later)."""
    import torch

    paths = [os.__file__, torch.__file__, str(Path(containment.__file__))]
    impl = config.getoption("--impl")
    if impl.endswith(".py") or os.sep in impl:
        paths.append(os.path.abspath(impl))
    if impl == "parallelism_conformance.adapters.cs336" and os.environ.get("CS336_SUBMISSION"):
        paths.append(os.path.abspath(os.environ["CS336_SUBMISSION"]))  # the submission the adapter loads
    return paths


def containment_note(config) -> str:
    """The coverage line's word on containment: graders and students see whether it held."""
    if contained(config):
        return "; ranks contained (a uid of their own per world, no privilege left)"
    if getattr(config.option, "hypothesis_profile", None) == "grading":
        return "; ranks NOT contained (--contain-ranks no): the implementation ran with the grader's rights"
    return ""
