"""DDP, then finish_gradient_synchronization all-reduces (AVG) every gradient again: right values, every gradient reduced twice.
targets: test_data_parallel_step
"""

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from parallelism_conformance.adapters.torch_native import *


class _TwiceReduced(DistributedDataParallel):
    def finish_gradient_synchronization(self) -> None:
        for param in self.module.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)  # already the mean on every rank


def DataParallel(module, bucket_size_mb=None):
    options = {} if bucket_size_mb is None else {"bucket_cap_mb": bucket_size_mb}
    return _TwiceReduced(module, broadcast_buffers=True, find_unused_parameters=True, **options)
