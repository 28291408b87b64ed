"""The runtime probes each stage's output shape with one extra forward under no_grad before its first microbatch: harmless without randomness, but the probe draws dropout masks, so every microbatch's masks move by one draw (the pattern of allenai/OLMo-core#828: a forward run twice without the saved random state).
targets: dropout
"""

import torch

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel


def _probed(module):
    forward, probed = module.forward, []

    def run(*args, **kwargs):
        if not probed:
            probed.append(True)
            with torch.no_grad():
                forward(*args, **kwargs)
        return forward(*args, **kwargs)

    module.forward = run


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, **options):
    for module in stages if isinstance(stages, (list, tuple)) else [stages]:
        _probed(module)
    return pipeline_parallel.pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule=schedule, group=group, **options)
