"""Self-tests of reference/data_parallel.py that need no ranks."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.data_parallel as ref
from parallelism_conformance.harness.rank import models


@given(data=st.data())
def test_a_global_batch_that_does_not_split_evenly_is_refused(data):
    """The driver-side splitter refuses B % n != 0 with a ValueError naming both (the wrapper never
    sees the global batch, so unequal slices must be stopped before the ranks run)."""
    world_size = data.draw(st.integers(2, 8), label="world_size")
    total = data.draw(st.integers(1, 40).filter(lambda b: b % world_size), label="global_batch")
    batch = models.make_batch({"kind": "mlp", "inputs": 2, "hidden": 2, "outputs": 1}, total, seed=0)
    with pytest.raises(ValueError, match=rf"batch of {total} samples .* world size {world_size} "):
        ref.split_batch(batch, world_size)
