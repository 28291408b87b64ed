"""Self-tests of reference/tensor_parallel.py that need no ranks."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.tensor_parallel as ref


@given(n=st.integers(2, 8), data=st.data())
def test_a_sequence_that_does_not_split_is_refused(n, data):
    """Sequence-parallel ranks hold equal contiguous shards; the driver-side splitter refuses a
    sequence length that is not a multiple of n (an implementation sees only its own shard and
    could not tell without communicating)."""
    length = data.draw(st.integers(1, 40).filter(lambda s: s % n), label="sequence length")
    with pytest.raises(ValueError, match=rf"sequence length = {length} .* group size {n} "):
        ref.sequence_shard(torch.zeros(2, length, 3), n, 0)
