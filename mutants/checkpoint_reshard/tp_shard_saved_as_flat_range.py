"""A tensor-parallel shard is saved and loaded as if it were a range of the flattened tensor: the row-parallel weight, cut along its columns, is not contiguous when flattened, so it round-trips at the same tensor-parallel size and lands scrambled under any other layout.
targets: tensor_parallel
"""
from impls import *
from impls import checkpointing


def _as_flat_ranges(model):
    split = original(model)
    for key, (kind, group, shape, dim) in list(split.items()):
        if kind == "block" and dim == 1:
            split[key] = ("flat_piece", group, shape, None)
    return split


original = checkpointing._split_tensors


def save_checkpoint(path, model, optimizer):
    checkpointing._split_tensors = _as_flat_ranges
    try:
        checkpointing.save_checkpoint(path, model, optimizer)
    finally:
        checkpointing._split_tensors = original


def load_checkpoint(path, model, optimizer):
    checkpointing._split_tensors = _as_flat_ranges
    try:
        checkpointing.load_checkpoint(path, model, optimizer)
    finally:
        checkpointing._split_tensors = original
