"""Gradients are summed across ranks instead of averaged.
targets: test_training_matches_one_process_on_the_global_batch
"""

import torch.distributed as dist

from parallelism_conformance.impls import *
from parallelism_conformance.impls.collectives import all_reduce
from parallelism_conformance.impls.data_parallel import NaiveDataParallel


class SummingDataParallel(NaiveDataParallel):
    def finish_gradient_synchronization(self):
        for p in self._trainable:
            if p.grad is not None:
                all_reduce(p.grad, op=dist.ReduceOp.SUM)


def DataParallel(module, bucket_size_mb=None):
    return SummingDataParallel(module)
