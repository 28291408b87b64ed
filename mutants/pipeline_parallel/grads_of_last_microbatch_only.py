"""Gradients keep only the last microbatch's contribution: .grad is zeroed inside the microbatch loop.
targets: dense_model

Every parameter's gradient is reset before each microbatch's backward adds to it (a zero_grad()
in the wrong loop), so after the step .grad holds dL_{m-1}/m alone. The loss is still right.
Invisible with m = 1.
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, trace=None):
    chunks = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    handles = []
    for chunk in chunks:
        for parameter in chunk.parameters():
            seen = [0]

            def forget_earlier_microbatches(param, seen=seen):
                seen[0] += 1
                if seen[0] < num_microbatches:
                    param.grad.zero_()  # bug: the next microbatch starts from zero again

            handles.append(parameter.register_post_accumulate_grad_hook(forget_earlier_microbatches))
    try:
        return _bundled.pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule=schedule, group=group, trace=trace)
    finally:
        for handle in handles:
            handle.remove()
