"""What the CS336 mutants share (not a mutant: the runner reads files not starting with '_'): each
is a student's tests/adapters.py whose FSDP is the project's CS336 fixture
(tests/fixtures/cs336_submission/cs336_systems/fsdp.py) with one bug, graded through
adapters.cs336 as a course grades a submission. The fixture's folders go on sys.path as a student's
installed packages would be."""

import sys
from pathlib import Path

from parallelism_conformance.adapters import cs336_metadata

SUBMISSION = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "cs336_submission"
for folder in (SUBMISSION / "cs336-basics", SUBMISSION):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
# The fixture's package reads its own version at import (importlib.metadata, as the 2026 template
# does); adapters.cs336 declares the distributions of the submission it loads, whose root here is
# mutants/, not the fixture: declared for the fixture, or every CS336 mutant failed to load and
# the runner counted that as its kill
cs336_metadata.declare(str(SUBMISSION))

from cs336_systems import fsdp  # noqa: E402 - importable only once the folders above are on the path


def handout_functions(fsdp_class):
    """The handout's three FSDP entry points over ``fsdp_class``."""

    def get_fsdp(module, compute_dtype=None):
        return fsdp_class(module, compute_dtype=compute_dtype)

    def fsdp_on_after_backward(fsdp_model, optimizer):
        fsdp_model.finish_gradient_synchronization()

    def fsdp_gather_full_params(fsdp_model):
        return fsdp_model.gather_full_params()

    return get_fsdp, fsdp_on_after_backward, fsdp_gather_full_params


class WithShards(fsdp.FSDP):
    """The fixture's FSDP building its shards with ``shard_class`` (a mutant's _Shard)."""

    shard_class = fsdp._Shard

    def __init__(self, module, compute_dtype=None):
        original, fsdp._Shard = fsdp._Shard, self.shard_class
        try:
            super().__init__(module, compute_dtype)
        finally:
            fsdp._Shard = original
