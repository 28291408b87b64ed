"""pipeline_step runs GPipe whatever schedule it is asked for: every number right, but m microbatches of activations held instead of at most p.
targets: dense_model

From issue 14: a runtime asked for 1F1B that runs all forwards, then all backwards, gets the loss and
every gradient right; only the order of the stages' forwards and backwards (hooks on the stage
modules) shows it.
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, trace=None):
    chunks = stages if isinstance(stages, (list, tuple)) else [stages]
    kind = "gpipe" if len(chunks) == 1 and isinstance(schedule, str) else schedule
    return _bundled.pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule=kind, group=group, trace=trace)
