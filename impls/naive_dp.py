"""The bundled implementations with the naive data-parallel wrapper as ``DataParallel``:
``--impl parallelism_conformance.impls.naive_dp`` grades NaiveDataParallel (all-reduce every gradient after backward)."""

from parallelism_conformance.impls import *  # noqa: F403 - the collectives, unchanged
from parallelism_conformance.impls import BucketedDataParallel, NaiveDataParallel, OverlappedDataParallel  # noqa: F401 - re-exported: the contract's names


def DataParallel(module, bucket_size_mb=None, process_group=None, gradient_divide_factor=None, compute_dtype=None):
    """NaiveDataParallel whatever ``bucket_size_mb`` says (it has no buckets)."""
    return NaiveDataParallel(module, process_group, gradient_divide_factor, compute_dtype)
