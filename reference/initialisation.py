"""The single-process initialisation a sharded one must reproduce: torch's own default.

``torch.manual_seed(seed)``, then every submodule's ``reset_parameters()`` in ``module.modules()``
order, each drawing from torch's default CPU generator on tensors of the parameter's dtype. For
``nn.Linear(in, out)`` that is (torch/nn/modules/linear.py):

    W ~ U(-b, b) by kaiming_uniform_(W, a=sqrt(5)),  b = gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in)
    bias ~ U(-1 / sqrt(fan_in), 1 / sqrt(fan_in)),  drawn after W

so a rank that holds a piece of W holds the elements of this draw at its piece's positions: a
fully sharded model built on the meta device and then initialised must hold, gathered, these
tensors bitwise (torchtitan#3106: every rank drew its own piece from the same seed, and the
"sharded" parameter was one piece repeated). The generator is forked, so the caller's stream is
left as it was. Never imports torch.distributed.
"""

from __future__ import annotations

import torch
from torch import nn


def default_initialisation(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """{name: parameter} of ``model`` after torch.manual_seed(seed) and each submodule's
    reset_parameters() in modules() order (``model`` is changed in place)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
