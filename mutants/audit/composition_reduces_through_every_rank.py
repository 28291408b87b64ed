"""Subgroup all-reduces (SUM) go through an all-gather over the whole world: right values, but tensor parallelism's traffic crosses hosts.
targets: test_composition_traffic_on_hosts

On a dp x tp mesh laid over hosts, every TP all-reduce, which should stay on a host's fast links,
sends to every rank of every host.
"""

import torch
import torch.distributed as dist

import parallelism_conformance.impls.collectives as _bundled
from parallelism_conformance.impls import *


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if group is None or op != dist.ReduceOp.SUM:
        return _bundled.all_reduce(tensor, op=op, group=group, async_op=async_op)
    members = dist.get_process_group_ranks(group)
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    _bundled.all_gather(pieces, tensor.contiguous())
    total = pieces[members[0]].clone()
    for rank in members[1:]:
        total += pieces[rank]
    tensor.copy_(total)
    return None
