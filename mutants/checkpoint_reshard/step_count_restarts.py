"""The optimizer's moments are restored but its step count starts again from zero: AdamW's bias correction restarts after the resume (momentum SGD, which counts no steps, is unaffected).
targets: test_a_checkpoint_resumes_under_another_layout_and_world_size
"""

import torch

from parallelism_conformance.impls import *
from parallelism_conformance.impls import checkpointing


def load_checkpoint(path, model, optimizer):
    checkpointing.load_checkpoint(path, model, optimizer)
    states = optimizer.optim.state if isinstance(optimizer, ShardedOptimizer) else optimizer.state
    for state in states.values():
        if "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0
