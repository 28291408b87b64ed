"""The training loop's side of a loss normalised by the global token count (CONTRACT.md, "Loss
normalised by the global token count"), as torchtitan trains: before a step's forward passes every
rank counts its valid targets over the step's micro-batches and asks the implementation for the sum
over the data-parallel group, C = sum_r c_r (``global_token_count``); each micro-batch's loss, the
sum of its per-token losses, is then multiplied by f / C, and the wrapper, built with
``gradient_divide_factor=f``, divides the summed gradients by f. The gradient is then the gradient
of (sum of every valid token's loss) / C, whatever the counts per rank and micro-batch."""

from __future__ import annotations

import torch

from parallelism_conformance.harness.rank import models
from parallelism_conformance.harness.rank.context import require


def scale_of_step(impl, micro: list, divide_factor: float, group=None) -> tuple[float, float]:
    """(f / C, C as the implementation returned it): ``micro`` is this rank's (inputs, targets) of
    the step. A count of zero or less gives a NaN scale: the driver judges the count first and
    names it."""
    global_token_count = require(impl, "global_token_count")
    local = sum(int((targets != models.IGNORE).sum()) for _, targets in micro)
    count = global_token_count(local, group=group)
    count = float(count.item() if torch.is_tensor(count) else count)
    return (divide_factor / count if count > 0 else float("nan")), count
