"""DataParallel also all-reduces the frozen parameters (as zeros, so the values stay right): traffic for gradients that do not exist.
targets: test_data_parallel_step
"""

import torch
import torch.distributed as dist

from parallelism_conformance import impls
from parallelism_conformance.impls import *
from parallelism_conformance.impls import NaiveDataParallel


class _ReducesEverything(NaiveDataParallel):
    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        for param in self.module.parameters():
            if not param.requires_grad:
                impls.all_reduce(torch.zeros_like(param), op=dist.ReduceOp.SUM, group=self.process_group)


def DataParallel(module, bucket_size_mb=None, process_group=None):
    return _ReducesEverything(module, process_group)
