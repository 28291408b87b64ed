"""init_sharded draws each rank's piece of a parameter on its own from the seed (the piece's own numbers, reshaped), where the piece must be its part of the whole parameter's draw: every rank holds the same numbers (pytorch/torchtitan#3106).
targets: test_a_model_built_on_meta_is_initialised_as_one_process_would
"""

import torch

import parallelism_conformance.impls.sharded_init as _bundled
from parallelism_conformance.impls import *


class _OwnPiece:
    """A unit whose _piece keeps the first piece-size elements of the draw on every rank."""

    def __init__(self, unit):
        self._unit = unit

    def _piece(self, full):
        piece = self._unit._piece(full)
        return full.reshape(-1)[: piece.numel()].clone() if full.numel() >= piece.numel() else piece


_layouts = _bundled._layouts


def _own_piece_layouts(module):
    return {key: (shape, _OwnPiece(unit)) for key, (shape, unit) in _layouts(module).items()}


def init_sharded(module, seed, device=None):
    _bundled._layouts = _own_piece_layouts
    try:
        return _bundled.init_sharded(module, seed, device)
    finally:
        _bundled._layouts = _layouts
