"""pipeline_step accepts scale_grads and ignores it: each microbatch's loss is still divided by m after the loss_fn divided by the global count of valid rows, so the gradient is m times too small (the PP gradients that disagree with the non-PP ones under global-token normalisation, torchtitan#2972).
targets: test_a_loss_normalised_by_the_valid_rows_sums_the_microbatches
"""

import parallelism_conformance.impls.pipeline_parallel as _bundled
from parallelism_conformance.impls import *


def pipeline_step(
    stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, trace=None, placement=None, scale_grads=True
):
    options = {} if placement is None else {"placement": placement}
    return _bundled.pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule, group, trace=trace, **options)
