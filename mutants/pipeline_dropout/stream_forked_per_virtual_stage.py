"""The runtime keeps one random state per stage it holds, each forked from the rank's generator when the call starts, and swaps it in around that stage's forwards: on one stage per rank that is the rank's stream, but with several (interleaved) every stage restarts the same stream, so a rank's stages draw the same masks.
targets: dropout
"""

import torch

from parallelism_conformance.impls import *
from parallelism_conformance.impls import pipeline_parallel


def _own_stream(module, start):
    forward, state = module.forward, [start]

    def run(*args, **kwargs):
        outer = torch.get_rng_state()
        torch.set_rng_state(state[0])
        try:
            return forward(*args, **kwargs)
        finally:
            state[0] = torch.get_rng_state()
            torch.set_rng_state(outer)

    module.forward = run
    return forward


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, **options):
    modules = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    start = torch.get_rng_state()
    originals = [_own_stream(module, start) for module in modules]
    try:
        return pipeline_parallel.pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule=schedule, group=group, **options)
    finally:
        for module, forward in zip(modules, originals):
            module.forward = forward
