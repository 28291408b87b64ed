"""DataParallel with compute_dtype divides every synchronized gradient by 65536, a loss scale that was never applied: every gradient ends 65536 times too small (DeepSpeed#7839: ZeRO-0 with bf16 divided gradients by 65536).
targets: test_compute_dtype_in_data_parallelism_keeps_float32_masters
"""

import parallelism_conformance.impls.data_parallel as _bundled
from parallelism_conformance.impls import *

_SCALE = 65536.0


class _ScaledDataParallel(_bundled.NaiveDataParallel):
    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        if self.compute_dtype is not None:
            for param in self._trainable:
                if param.grad is not None:
                    param.grad.div_(_SCALE)


def DataParallel(module, bucket_size_mb=None, process_group=None, gradient_divide_factor=None, compute_dtype=None):
    return _ScaledDataParallel(module, process_group, gradient_divide_factor, compute_dtype)
