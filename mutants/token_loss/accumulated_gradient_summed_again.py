"""With gradient_divide_factor, DataParallel sums the whole accumulated .grad after every micro-batch, as averaging may: the part synchronized after earlier micro-batches is counted n times more at every later one (torchtitan#1733's accumulated gradients rescaled at every micro-step, here in DP).
targets: test_data_parallel_gradients_are_the_mean_over_every_valid_token
"""

import parallelism_conformance.impls.data_parallel as _bundled
from parallelism_conformance.impls import *


class _ResummingDataParallel(_bundled.NaiveDataParallel):
    def finish_gradient_synchronization(self):
        for param in self._trainable:
            if param.grad is not None:
                _bundled._reduce_(param.grad, self.process_group, self.divide_factor)


def DataParallel(module, bucket_size_mb=None, process_group=None, gradient_divide_factor=None):
    return _ResummingDataParallel(module, process_group, gradient_divide_factor)
