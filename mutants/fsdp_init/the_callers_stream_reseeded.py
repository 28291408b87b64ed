"""init_sharded seeds torch's default generator with the model's seed and leaves it there: every rank's own random stream (its dropout masks) restarts from the same seed after initialisation, so the ranks draw the same masks (Megatron-LM#206's class: one seed where each rank needs its own stream).
targets: test_a_model_built_on_meta_is_initialised_as_one_process_would
"""

import torch

import parallelism_conformance.impls.sharded_init as _bundled
from parallelism_conformance.impls import *


def init_sharded(module, seed, device=None):
    result = _bundled.init_sharded(module, seed, device)
    torch.manual_seed(seed)
    return result
