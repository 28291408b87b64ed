"""The owners' parameters are all-gathered into one buffer reused from step to step, never zeroed, and copied out of it before the all-gather's wait: each rank takes whatever the buffer holds, last step's values where the gather has not landed.
targets: test_sharded_training_matches_one_process_with_the_whole_state
race: killed by --perturb-timing, naming the call; without it by values only when gloo's timing shows it (docs/measured.md)

Each owner packs its updated parameters into its slot of B elements, and
dist.all_gather_into_tensor(async_op=True) fills a flat buffer of n B elements kept across steps.
The parameters are copied back out of that buffer right after the launch and the wait comes last;
since the buffer is reused without zeroing, an early read finds the previous step's parameters,
close to right, instead of zeros: nothing looks wrong by eye.
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
        self.size, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.owners = assign_owners([p.numel() for p in self.trainable], self.size)
        loads = [0] * self.size
        self.offsets = []
        for p, owner in zip(self.trainable, self.owners):
            self.offsets.append(loads[owner])
            loads[owner] += p.numel()
        self.slot = max(loads + [1])
        like = self.trainable[0] if self.trainable else torch.zeros(1)
        self.gathered = torch.zeros(self.slot * self.size, dtype=like.dtype, device=like.device)  # reused
        mine = [p for p, o in zip(self.trainable, self.owners) if o == self.me]
        self.optim = optimizer_class(mine or [torch.nn.Parameter(torch.zeros(0))], **defaults)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def step(self):
        for p in self.trainable:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad /= self.size
        self.optim.step()
        with torch.no_grad():
            mine = torch.zeros(self.slot, dtype=self.gathered.dtype, device=self.gathered.device)
            for p, owner, offset in zip(self.trainable, self.owners, self.offsets):
                if owner == self.me:
                    mine[offset : offset + p.numel()] = p.reshape(-1)
            work = dist.all_gather_into_tensor(self.gathered, mine, group=self.group, async_op=True)
            for p, owner, offset in zip(self.trainable, self.owners, self.offsets):  # the bug: before the wait
                start = owner * self.slot + offset
                p.copy_(self.gathered[start : start + p.numel()].view_as(p))
            work.wait()
