"""The owners' updated parameters are broadcast asynchronously and waited for only at the start of the next step(): the forward in between, and whatever reads the parameters after step(), see them in flight.
targets: test_sharded_training_matches_one_process_with_the_whole_state
race: killed by --perturb-timing, naming the call; without it by values only when gloo's timing shows it (docs/measured.md)

A ZeRO-1 as CS336 submissions write it with torch.distributed's own collectives: gradients
all-reduced (sum, then divided by n), each owner steps its parameters, then one
broadcast(async_op=True) per parameter from its owner, kept in a list that the next step() waits
for before touching gradients. The next forward reads parameters whose broadcast has not been
waited for; gloo's broadcasts land late enough to fail on values too (5 of 5 runs without
--perturb-timing), but nothing then says which call.
"""

import torch
import torch.distributed as dist

from parallelism_conformance.impls import *  # noqa: F403
from parallelism_conformance.impls.sharded_optimizer import assign_owners


class ShardedOptimizer:
    def __init__(self, params, optimizer_class, group=None, **defaults):
        self.group = group
        self.params = list(params)
        self.trainable = [p for p in self.params if p.requires_grad]
        size, me = dist.get_world_size(group), dist.get_rank(group)
        owners = assign_owners([p.numel() for p in self.trainable], size)
        self.source = [o if group is None else dist.get_global_rank(group, o) for o in owners]
        mine = [p for p, o in zip(self.trainable, owners) if o == me]
        self.optim = optimizer_class(mine or [torch.nn.Parameter(torch.zeros(0))], **defaults)
        self.in_flight = []

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def step(self):
        for work in self.in_flight:  # the bug: the last step's broadcasts, waited only now
            work.wait()
        self.in_flight = []
        size = dist.get_world_size(self.group)
        for p in self.trainable:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad /= size
        self.optim.step()
        with torch.no_grad():
            for p, source in zip(self.trainable, self.source):
                self.in_flight.append(dist.broadcast(p.data, src=source, group=self.group, async_op=True))
