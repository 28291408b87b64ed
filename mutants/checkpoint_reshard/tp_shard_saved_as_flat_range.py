"""A tensor-parallel shard is saved and loaded as if it were a range of the flattened tensor: the row-parallel weight, cut along its columns, is not contiguous when flattened, so it round-trips at the same tensor-parallel size and lands scrambled under any other layout.
targets: tensor_parallel
"""

from mutants._swap import swapped
from parallelism_conformance.impls import *
from parallelism_conformance.impls import checkpointing


def _as_flat_ranges(model, split_tensors=checkpointing._split_tensors):
    split = split_tensors(model)
    for key, (kind, group, shape, dim) in list(split.items()):
        if kind == "block" and dim == 1:
            split[key] = ("flat_piece", group, shape, None)
    return split


def save_checkpoint(path, model, optimizer):
    with swapped(checkpointing, _split_tensors=_as_flat_ranges):
        checkpointing.save_checkpoint(path, model, optimizer)


def load_checkpoint(path, model, optimizer):
    with swapped(checkpointing, _split_tensors=_as_flat_ranges):
        checkpointing.load_checkpoint(path, model, optimizer)
