"""A bucket is reduced when the count of its gradients that are ready reaches its size: a bucket holding a parameter unused in the step never fills, so its other parameters keep their local gradients (the bucketed DDP of 7 of 12 CS336 assignment-2 submissions we graded).
targets: test_tied_frozen_and_unused_parameters and skips
"""

import torch
import torch.distributed as dist
from torch import nn

from parallelism_conformance.impls import *

MIB = 1024 * 1024


class CountingBucketedDDP(nn.Module):
    def __init__(self, module, bucket_size_mb):
        super().__init__()
        self.module = module
        for tensor in [*module.parameters(), *module.buffers()]:
            broadcast(tensor.data, src=0)  # noqa: F405 - the implementation's own broadcast
        unique, seen = [], set()
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        cap = float("inf") if bucket_size_mb is None else bucket_size_mb * MIB
        self.buckets, current, size = [], [], 0
        for p in reversed(unique):  # roughly the order backward produces gradients
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > cap:
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(current)
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        for p in unique:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p):
        i = self.bucket_of[id(p)]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):  # every gradient of the bucket is in
            bucket = self.buckets[i]
            flat = torch.cat([q.grad.reshape(-1) for q in bucket])
            all_reduce(flat)
            flat /= dist.get_world_size()
            offset = 0
            for q in bucket:
                q.grad.copy_(flat[offset : offset + q.numel()].view_as(q.grad))
                offset += q.numel()

    def forward(self, *a, **k):
        return self.module(*a, **k)

    def finish_gradient_synchronization(self):
        self.ready = [0] * len(self.buckets)


def DataParallel(module, bucket_size_mb=None):
    return CountingBucketedDDP(module, bucket_size_mb)
