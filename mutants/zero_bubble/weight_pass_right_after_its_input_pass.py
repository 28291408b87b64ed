"""pipeline_step runs every W right after its I, whatever the schedule says: the deferral that fills ZB-H1's bubbles never happens.
targets: zb_h1_step or split_schedule

A runtime that splits the backward (so it "has" I and W) but keeps a simple loop: after computing
the input gradient it immediately computes the weight gradient. Valid and numerically right, and
the bubble is 1F1B's.
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel as _bundled
from parallelism_conformance.impls.pipeline_parallel import *


def _rows(schedule, p, m, v):
    rows = _bundled.generate_schedule(schedule, p, m, v) if isinstance(schedule, str) else schedule(p, m, v)
    out = []
    for row in rows:
        kept = [a for a in row if "W" not in a]
        moved = []
        for a in kept:
            moved.append(a)
            stage, kind, i = _bundled._parse(a)
            if kind == "I":
                moved.append(f"{stage}W{i}")
        out.append(moved)
    return out


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, trace=None):
    return _bundled.pipeline_step(
        stages, inputs, targets, loss_fn, num_microbatches, group=group, trace=trace, schedule=lambda p, m, v: _rows(schedule, p, m, v)
    )
