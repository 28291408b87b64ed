"""The loss is summed over microbatches instead of averaged: the loss and every gradient are m times too large.
targets: dense_model

A classic slip when porting a single-batch training loop: each microbatch's loss is backpropagated
as it is, without the 1/m, so the gradients are those of sum_i loss_i (and the loss returned is
the sum). Invisible with m = 1.
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, trace=None):
    def summed(output, target):
        return loss_fn(output, target) * num_microbatches  # bug: (1/m) sum_i (m loss_i) = sum_i loss_i

    return _bundled.pipeline_step(stages, inputs, targets, summed, num_microbatches, schedule=schedule, group=group, trace=trace)
