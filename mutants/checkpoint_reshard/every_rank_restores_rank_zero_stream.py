"""Every rank restores the random generator state rank 0 saved: the resumed ranks all draw the same dropout masks and data orders, where each had its own (Megatron-LM#6858).
targets: random_stream
"""

import torch
import torch.distributed as dist

from mutants._swap import swapped
from parallelism_conformance.impls import *
from parallelism_conformance.impls import checkpointing


def _from_rank_zero(metadata, contents):
    if metadata["world_size"] == dist.get_world_size():
        torch.set_rng_state(contents[0]["rng"])


def load_checkpoint(path, model, optimizer):
    with swapped(checkpointing, _restore_random_stream=_from_rank_zero):
        checkpointing.load_checkpoint(path, model, optimizer)
