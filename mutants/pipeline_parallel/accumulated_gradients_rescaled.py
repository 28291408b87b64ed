"""pipeline_step backpropagates every microbatch's undivided loss and divides each stage's whole .grad by m at the end, as torch's stage.scale_grads does: what earlier pipeline_step calls accumulated is divided again (torchtitan#1733: accumulated gradients rescaled at every step).
targets: test_gradients_accumulate_across_pipeline_steps
"""

import parallelism_conformance.impls.pipeline_parallel as _bundled
from parallelism_conformance.impls import *


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, placement=None, trace=None):
    m = num_microbatches
    options = {} if placement is None else {"placement": placement}
    loss = _bundled.pipeline_step(
        stages, inputs, targets, lambda output, target: loss_fn(output, target) * m, m, schedule, group, trace=trace, **options
    )
    for stage in stages if isinstance(stages, (list, tuple)) else [stages]:
        for parameter in stage.parameters():
            if parameter.grad is not None:
                parameter.grad.div_(m)
    return None if loss is None else loss / m
