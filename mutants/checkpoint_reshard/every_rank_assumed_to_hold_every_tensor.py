"""Whole tensors are split for writing among all the world's ranks, as if every rank held every tensor (true under data parallelism): on a pipeline mesh a stage's tensors are written only in the shares of the ranks holding that stage, and the rest of each is in no file.
targets: pipeline
"""

import torch.distributed as dist

from mutants._swap import swapped
from parallelism_conformance.impls import *
from parallelism_conformance.impls import checkpointing


def _everyone_holds(mine, device, world_view=checkpointing._world_view):
    view = world_view(mine, device)
    for entry in view.values():
        if entry["holders"]:
            entry["holders"] = list(range(dist.get_world_size()))
    return view


def save_checkpoint(path, model, optimizer):
    with swapped(checkpointing, _world_view=_everyone_holds):
        checkpointing.save_checkpoint(path, model, optimizer)
