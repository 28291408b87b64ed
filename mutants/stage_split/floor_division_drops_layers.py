"""split_stages gives every stage L // S layers: the L mod S layers left over are in no stage (Megatron-LM#1304: 30 layers at PP=4 built only 28, without a warning).
targets: test_split_stages_cuts_every_layer_once_in_order
"""

from torch import nn

from parallelism_conformance.impls import *


def split_stages(model, num_stages):
    layers = list(model.children())
    if num_stages < 1 or len(layers) < num_stages:
        raise ValueError(f"cannot split num_layers={len(layers)} into num_stages={num_stages}")
    size = len(layers) // num_stages
    return [nn.Sequential(*layers[s * size : (s + 1) * size]) for s in range(num_stages)]
