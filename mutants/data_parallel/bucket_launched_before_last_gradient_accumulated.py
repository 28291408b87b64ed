"""A bucket's all-reduce is launched from a tensor hook of its last gradient, which runs before autograd accumulates that gradient into the bucket: the reduction races the accumulation.
targets: test_gradient_accumulation_and_both_zero_grad_modes
race: killed by --perturb-timing, naming the call; without it by values only when gloo's timing shows it (docs/measured.md)

Gradients are views into flat buckets (torch's gradient_as_bucket_view), so autograd accumulates
each .grad into its bucket in place; the bucket's asynchronous all-reduce is launched when the
last of its parameters' tensor hooks (Tensor.register_hook) has fired. A tensor hook runs before
the gradient is accumulated (register_post_accumulate_grad_hook runs after): the all-reduce is in
flight while autograd still adds the last gradient into the bucket. gloo's thread reads the
bucket before that addition often enough to fail on values (2 of 2 runs without
--perturb-timing); --perturb-timing names the write into the output in flight.
"""

import torch
import torch.distributed as dist
from torch import nn

from parallelism_conformance.impls import *  # noqa: F403

MIB = 1024 * 1024


class EarlyLaunchDDP(nn.Module):
    def __init__(self, module, bucket_size_mb):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                broadcast(tensor.detach(), src=0)  # noqa: F405 - the implementation's own broadcast
        trainable = [p for p in module.parameters() if p.requires_grad]
        cap = float("inf") if bucket_size_mb is None else bucket_size_mb * MIB
        self.buckets, current, size = [], [], 0
        for p in reversed(trainable):
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > cap or p.dtype != current[0].dtype):
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(current)
        self.flats = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype) for b in self.buckets]
        self.views = {}
        for bucket, flat in zip(self.buckets, self.flats):
            offset = 0
            for p in bucket:
                self.views[id(p)] = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.fired = [set() for _ in self.buckets]
        self.works = {}
        self.held = set()
        for p in trainable:
            p.register_hook(lambda grad, p=p: self._on_gradient(p, grad))

    def _on_gradient(self, p, grad):
        i = self.bucket_of[id(p)]
        self.fired[i].add(id(p))
        if len(self.fired[i]) == len(self.buckets[i]) and i not in self.works:
            self.works[i] = dist.all_reduce(self.flats[i], async_op=True)  # the bug: p's gradient is not in yet
        return grad

    def forward(self, *a, **k):
        self.held = set()
        for bucket in self.buckets:
            for p in bucket:
                if p.grad is None:  # set_to_none: the bucket's slot, zeroed, is .grad again
                    view = self.views[id(p)]
                    view.zero_()
                    p.grad = view
                else:
                    self.held.add(id(p))
        return self.module(*a, **k)

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.works:  # a parameter no forward used: its bucket never filled
                self.works[i] = dist.all_reduce(self.flats[i], async_op=True)
        for i, work in sorted(self.works.items()):
            work.wait()
            self.flats[i] /= dist.get_world_size()
            for p in self.buckets[i]:
                if id(p) not in self.fired[i] and id(p) not in self.held:
                    p.grad = None  # no gradient this step, as in one process
        self.works, self.fired = {}, [set() for _ in self.buckets]


def DataParallel(module, bucket_size_mb=None):
    return EarlyLaunchDDP(module, bucket_size_mb)
