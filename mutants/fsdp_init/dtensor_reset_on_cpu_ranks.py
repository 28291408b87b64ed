"""init_sharded runs torchtitan's flow on torch's FSDP2: to_empty, torch.manual_seed(seed), then each submodule's reset_parameters() on its DTensor parameters; off CUDA, DTensor's random ops fall back to each rank's own generator, which draws the same numbers for every rank's shard (pytorch/torchtitan#3106: FSDP2 with CPU offload gave every rank identical random shards).
targets: test_a_model_built_on_meta_is_initialised_as_one_process_would
"""

import torch

from parallelism_conformance.adapters.torch_native import *  # noqa: F403


def init_sharded(module, seed, device=None):
    module.to_empty(device=torch.device("cpu") if device is None else device)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for owner in module.modules():
            reset = getattr(owner, "reset_parameters", None)
            if callable(reset):
                reset()
    return module
