"""DataParallel ignores gradient_divide_factor and still averages over ranks after the loss was divided by the global token count: the gradient divided twice, n times too small (torchtitan#2323).
targets: test_data_parallel_gradients_are_the_mean_over_every_valid_token
"""

import parallelism_conformance.impls.data_parallel as _bundled
from parallelism_conformance.impls import *


def DataParallel(module, bucket_size_mb=None, process_group=None, gradient_divide_factor=None):
    return _bundled.DataParallel(module, bucket_size_mb, process_group)
