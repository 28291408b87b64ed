"""DataParallel with compute_dtype casts the module itself to it: the optimizer, built over module.parameters(), then keeps low-precision masters and state (TensorAuto/OpenTau#181: a model cast to bf16 before its optimizer was built kept bf16 AdamW state).
targets: test_compute_dtype_in_data_parallelism_keeps_float32_masters
"""

import parallelism_conformance.impls.data_parallel as _bundled
from parallelism_conformance.impls import *


def DataParallel(module, bucket_size_mb=None, process_group=None, gradient_divide_factor=None, compute_dtype=None):
    if compute_dtype is not None:
        module = module.to(compute_dtype)
    return _bundled.DataParallel(module, bucket_size_mb, process_group, gradient_divide_factor)
