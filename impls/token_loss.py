"""The count behind a loss normalised by the global token count: every data-parallel rank counts
the valid targets of its micro-batches for the step, and the loss of each is divided by the sum
over the group, C = sum_r c_r (one all-reduce of one integer), so that every token of the global
batch weighs 1/C whatever rank holds it. The wrappers then sum the gradients instead of averaging
them (``gradient_divide_factor=1``: impls/data_parallel.py, impls/fully_sharded.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_reduce


def global_token_count(local_count, group=None) -> int:
    """sum over the group's ranks of ``local_count`` (an int or a one-element integer tensor)."""
    count = torch.tensor([int(local_count)], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        count = count.cuda()
    all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return int(count.item())
