"""broadcast sends the whole tensor from the root to every member in turn: right values, (n-1) S from the root instead of ceil(log2 n) S.
targets: test_bytes_sent_within_bound and broadcast
"""

import torch.distributed as dist

from parallelism_conformance.impls import *


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if dist.get_rank() not in ranks:
        return None
    root = ranks[group_src] if group_src is not None else (src if src is not None else ranks[0])
    flat = tensor.contiguous().view(-1) if tensor.numel() else None
    if flat is None:
        return None
    if dist.get_rank() == root:
        works = [dist.isend(flat, dst=r, group=group) for r in ranks if r != root]
        for work in works:
            work.wait()
    else:
        dist.recv(flat, src=root, group=group)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
    return None
