"""A bucket's averaged gradient is copied back into .grad before its all-reduce was waited for: it waits only for the bucket it launched last, and reads the others' results as they stand.
targets: test_bucketed_gradients_are_the_mean_over_ranks
race: killed by --perturb-timing, naming the call; without it by values only when gloo's timing shows it (docs/measured.md)

Each bucket's all-reduce is launched asynchronously (torch.distributed, async_op=True) from the
post-accumulate-grad hook of the bucket's last gradient. finish_gradient_synchronization waits for
the last one launched only, reasoning that the earlier ones went first, then copies every bucket
back and only then waits for the rest. On gloo the earlier buckets have often finished by then
(of 5 runs without --perturb-timing, 1 passed and 4 failed as nondeterminism); a backend that
completes them in another order (NCCL streams, --perturb-timing) hands back a bucket whose
reduction is still in flight.
"""

import torch
import torch.distributed as dist
from torch import nn

from parallelism_conformance.impls import *  # noqa: F403

MIB = 1024 * 1024


class EarlyCopyDDP(nn.Module):
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
            if current and size + nbytes > cap:
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(current)
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [set() for _ in self.buckets]
        self.inflight = []
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p):
        i = self.bucket_of[id(p)]
        if self.ready[i] is None:
            return
        self.ready[i].add(id(p))
        if len(self.ready[i]) == len(self.buckets[i]):
            self._launch(i)

    def _launch(self, i):
        bucket = self.buckets[i]
        self.ready[i] = None  # launched
        flat = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1) for q in bucket])
        self.inflight.append((bucket, flat, dist.all_reduce(flat, async_op=True)))

    def forward(self, *a, **k):
        return self.module(*a, **k)

    def finish_gradient_synchronization(self):
        for i, ready in enumerate(self.ready):  # a bucket holding a parameter no forward used this step
            if ready:
                self._launch(i)
        inflight, self.inflight = self.inflight, []
        self.ready = [set() for _ in self.buckets]
        if inflight:
            inflight[-1][2].wait()  # the bucket launched last
        for bucket, flat, _ in inflight:  # the bug: the others are read before their wait
            offset = 0
            for q in bucket:
                if q.grad is not None:
                    q.grad.copy_(flat[offset : offset + q.numel()].view_as(q.grad) / dist.get_world_size())
                offset += q.numel()
        for _, _, work in inflight:
            work.wait()


def DataParallel(module, bucket_size_mb=None):
    return EarlyCopyDDP(module, bucket_size_mb)
