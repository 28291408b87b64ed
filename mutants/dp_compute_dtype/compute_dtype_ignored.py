"""DataParallel accepts compute_dtype and ignores it: everything runs in float32 (on the exact examples the values are right; the logits' dtype says so).
targets: test_compute_dtype_in_data_parallelism_keeps_float32_masters
"""

import parallelism_conformance.impls.data_parallel as _bundled
from parallelism_conformance.impls import *


def DataParallel(module, bucket_size_mb=None, process_group=None, gradient_divide_factor=None, compute_dtype=None):
    return _bundled.DataParallel(module, bucket_size_mb, process_group, gradient_divide_factor)
