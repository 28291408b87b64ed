"""pipeline_step on the V takes the rank's two chunks in the other order (the arm coming back first), so stage r runs stage 2p - 1 - r's layers.
targets: zb_v_step or any_valid_schedule_on_the_v

A mix-up the V invites: in the loop placement a rank's chunks are r, r + p, ..., and a runtime that
keys them by "the rank's stages, the way back first" for the V (stages 2p - 1 - r, then r) runs
each stage with the other arm's layers. Shapes may even agree (a model of equal widths); the loss
and gradients do not.
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, trace=None, placement=None):
    if placement == "v" or schedule == "zb-v":
        stages = list(stages)[::-1]
    return _bundled.pipeline_step(
        stages, inputs, targets, loss_fn, num_microbatches, schedule=schedule, group=group, trace=trace, placement=placement
    )
