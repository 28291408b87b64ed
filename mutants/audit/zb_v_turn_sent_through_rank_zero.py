"""ZB-V's runtime also relays what crosses the turn of the V (stage p - 1 to stage p, both on rank p - 1) through rank 0 and back, besides handing it over locally: right values, bytes that need not travel.
targets: on_the_v

A runtime written for the loop placement, where every boundary between stages is a boundary between
ranks, sends each stage's output to "the rank of the next stage" through one hub when it cannot
tell local from remote; here it also sends (a stand-in of) the activations and gradients at the
bottom of the V to rank 0, which sends them straight back. Every number is right; the audit sees bytes that need not
travel, and sends to a rank that is not a neighbour on the V.
"""

import torch
import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, trace=None, placement=None):
    result = _bundled.pipeline_step(
        stages, inputs, targets, loss_fn, num_microbatches, schedule=schedule, group=group, trace=trace, placement=placement
    )
    if (placement == "v" or schedule == "zb-v") and dist.get_world_size(group) > 1:
        p, rank = dist.get_world_size(group), dist.get_rank(group)
        relay = torch.zeros(num_microbatches * 2 * 8, dtype=torch.float32)  # the turn's traffic, both ways
        hub = dist.get_global_rank(group, 0) if group is not None else 0
        me = dist.get_global_rank(group, p - 1) if group is not None else p - 1
        if rank == p - 1:
            dist.send(relay, hub, group=group)
            dist.recv(relay, hub, group=group)
        elif rank == 0:
            dist.recv(relay, me, group=group)
            dist.send(relay, me, group=group)
    return result
