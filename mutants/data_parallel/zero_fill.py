"""A parameter without a gradient gets a zero gradient, so momentum and weight decay move it.
targets: test_training_matches_one_process_on_the_global_batch
"""

import torch

from parallelism_conformance.impls import *
from parallelism_conformance.impls.data_parallel import NaiveDataParallel


class ZeroFill(NaiveDataParallel):
    def finish_gradient_synchronization(self):
        for p in self._trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        super().finish_gradient_synchronization()


def DataParallel(module, bucket_size_mb=None):
    return ZeroFill(module)
