"""pipeline_step runs each split backward whole (B) where its I is and ignores the W: every number right, no weight pass deferred, no bubble filled.
targets: zb_h1_step or split_schedule

The simplest way to "support" zero-bubble schedules: treat I as B and W as a no-op. The loss and
every gradient match the dense model; only the order in which the stages' parameter gradients are
accumulated (hooks on the stage modules) shows that the schedule run is 1F1B's, not ZB-H1's.
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def _rows(schedule, p, m, v):
    rows = _bundled.generate_schedule(schedule, p, m, v) if isinstance(schedule, str) else schedule(p, m, v)
    return [[a.replace("I", "B") for a in row if "W" not in a] for row in rows]


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, trace=None):
    return _bundled.pipeline_step(
        stages, inputs, targets, loss_fn, num_microbatches, group=group, trace=trace, schedule=lambda p, m, v: _rows(schedule, p, m, v)
    )
