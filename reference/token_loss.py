"""Single-process truth for a loss normalised by the global token count.

A step of k micro-batches, each split across n ranks; slice (r, j) holds c_rj valid targets (the
others are IGNORE: padding, prompts), some none at all, and S_rj, the sum of its per-token losses.
The step's loss is the mean over every valid token of the global batch,

    L = (1/C) sum_r sum_j S_rj,   C = sum_r sum_j c_rj,

each token weighing 1/C whatever its rank and micro-batch. Rank r backpropagates (f/C) S_rj for
each of its micro-batches (C from ``global_token_count``, an all-reduce of the ranks' counts) and
the wrapper sums the gradients over ranks and divides by f (``gradient_divide_factor``):

    g = (1/f) sum_r sum_j grad (f S_rj / C) = grad L.

The bugs this catches each scale or reweight g and leave a loss curve looking normal under AdamW,
whose update is invariant to the gradient's scale:
- averaging over ranks as well (torchtitan#2323: divided twice): g / n;
- this rank's own count for C (each rank normalises its own tokens; NeMo Automodel#3830 reported
  the gradient dp x accumulation times the global mean): sum_r grad S_r / c_r, tokens of a rank
  with few valid targets weighing more;
- the mean of per-slice means, (1/n) sum_r (1/k) sum_j S_rj / c_rj, equal to L only when every c_rj
  is the same.

``evaluate`` and the tolerance build on reference/data_parallel.py (the same slices, the same
backward passes, one sum over ranks in rank order). Never imports torch.distributed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import parallelism_conformance.reference.data_parallel as ref
from parallelism_conformance.reference.data_parallel import IGNORE, valid_targets

__all__ = ["IGNORE", "counts", "evaluate", "valid_targets"]


def counts(batch: dict[str, Tensor], world_size: int, micro_batches: int) -> list[list[int]]:
    """c_rj: [rank][micro-batch] valid targets of each slice of ``batch``."""
    micro = ref.split_micro_batches(batch, micro_batches)
    return [[valid_targets(ref.split_batch(b, world_size)[r]) for b in micro] for r in range(world_size)]


def evaluate(
    model: nn.Module, batch: dict[str, Tensor], world_size: int, micro_batches: int = 1, had_grad: frozenset = frozenset(), device: str = "cpu"
) -> ref.Evaluation:
    """The next step at ``model``'s state (``model`` returns the sum of its per-token losses): each
    rank's S_rj (``slice_losses``), and g = (1/C) sum_r sum_j grad S_rj, summed over ranks in rank
    order; ``slice_grad_means`` holds (1/C) sum_r sum_j |grad S_rj|, the summands' magnitude that
    reference/data_parallel.py's ``grad_atol`` scales (the same bound: the ranks' sum over n terms
    and two multiplications by f/C and 1/f, each one rounding)."""
    total = valid_targets(batch)
    if total == 0:
        raise ValueError("the global batch has no valid target: the loss normalised by the global token count is 0/0")
    sums = ref.evaluate(model, batch, world_size, micro_batches, had_grad, device)
    names = list(sums.slice_grads[0])

    def over_ranks(name: str, magnitude: bool = False) -> Tensor:
        result = torch.zeros_like(sums.slice_grads[0][name])
        for grads in sums.slice_grads:
            result += grads[name].abs() if magnitude else grads[name]
        return result / total

    return ref.Evaluation(
        grads={name: over_ranks(name) for name in names},
        slice_losses=sums.slice_losses,
        slice_grad_means={name: over_ranks(name, magnitude=True) for name in names},
        slice_grads=sums.slice_grads,
    )
