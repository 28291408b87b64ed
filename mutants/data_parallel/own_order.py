"""Each rank sums the gathered gradients starting from its own, so ranks differ in the last bits.
targets: test_training_matches_one_process_on_the_global_batch
"""

import torch
import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls.collectives import all_gather
from parallelism_conformance.impls.data_parallel import NaiveDataParallel


class OwnOrder(NaiveDataParallel):
    def finish_gradient_synchronization(self):
        n, me = dist.get_world_size(), dist.get_rank()
        for p in self._trainable:
            if p.grad is None:
                continue
            parts = [torch.empty_like(p.grad) for _ in range(n)]
            all_gather(parts, p.grad.contiguous())
            acc = parts[me].clone()
            for k in range(1, n):
                acc += parts[(me + k) % n]
            p.grad.copy_(acc / n)


def DataParallel(module, bucket_size_mb=None):
    return OwnOrder(module)
