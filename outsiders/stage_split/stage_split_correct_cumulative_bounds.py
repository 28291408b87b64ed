"""Correct: stage boundaries taken from a running sum of tensor_split-style sizes, each stage a new Sequential over the model's own layers.

verdict: pass
capability: stage_split

Written from the contract alone: with L layers and S stages, q, r = divmod(L, S) and stage s is
q + 1 layers long for s < r and q otherwise (torch.tensor_split's rule, 30 in 4 -> 8, 8, 7, 7).
Rather than slicing in a loop with a moving cursor, the S + 1 cut points are built once as the
running sum of those sizes (starting at 0, ending at exactly L), and stage s is the slice between
cut points s and s + 1 of the model's children, listed once in order. Each slice is wrapped in a
fresh ``nn.Sequential`` of the very same module objects (no deepcopy), so the stages share
parameters with the model and running them one after another is the model's forward. Fewer
layers than stages (and a non-positive stage count) raises ``ValueError`` naming both numbers
before anything is built.
"""
from itertools import accumulate

import torch.nn as nn


def _stage_sizes(num_layers, num_stages):
    q, r = divmod(num_layers, num_stages)
    return [q + (1 if s < r else 0) for s in range(num_stages)]


def split_stages(model, num_stages):
    layers = list(model)
    num_layers = len(layers)
    if num_stages < 1:
        raise ValueError(
            f"cannot split a model of {num_layers} layers into {num_stages} stages: "
            f"the number of stages must be at least 1")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot split a model of {num_layers} layers into {num_stages} stages: "
            f"fewer layers ({num_layers}) than stages ({num_stages})")
    cuts = [0, *accumulate(_stage_sizes(num_layers, num_stages))]
    assert cuts[-1] == num_layers
    return [nn.Sequential(*layers[lo:hi]) for lo, hi in zip(cuts, cuts[1:])]
