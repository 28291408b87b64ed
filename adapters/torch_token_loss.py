"""torch's own count behind a loss normalised by the global token count, as torchtitan obtains it:
``dist.all_reduce`` of the local count (SUM) over the data-parallel group. The wrappers' divide
factor is in adapters/torch_ddp.py (a communication hook) and adapters/torch_fsdp.py
(``set_gradient_divide_factor``)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_token_count(local_count, group=None) -> int:
    count = torch.tensor([int(local_count)], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        count = count.cuda()
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return int(count.item())
