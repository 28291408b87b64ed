"""Single-process truth for pipeline parallelism: the whole sequential model (its stages run one
after the other) on the full batch, forward and backward by plain autograd.

The batch is cut into m microbatches along dim 0 by ``torch.tensor_split`` (sizes differ by at
most one; the batch needs at least m samples), and the loss is the mean over microbatches of the
per-microbatch loss:

    L = (1/m) * sum_i loss_fn(model(x_i), y_i),

which is what GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2021) accumulate: each
microbatch's backward adds dL_i/m to the gradients. Gradients are keyed by a stable name,
``stage<s>.<parameter name inside stage s>``.

Tolerance (``Dense.grad_atol``, ``Dense.loss_atol``): a pipeline computes every microbatch's
forward and backward with the same operations as this reference; what may differ is the order in
which the m per-microbatch gradients g_i are added and where the 1/m is applied. Recursive
summation of m terms is within (m - 1) u sum_i |g_i| (Higham 2002, section 4.2); scaling at another
point of a chain of L operations moves each term by at most about L u. The bound allowed for every
element of a parameter's gradient is normwise:

    ATOL_FACTOR * (m + L) * u * max_elements(sum_i |g_i|),   L = number of parameter tensors,

with u the dtype's unit roundoff (1.1e-16 in float64, the dtype the suite uses), and
ATOL_FACTOR * (m + 2) * u * sum_i |loss_i| / m for the loss. Never imports torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from parallelism_conformance.reference.tolerance import unit_roundoff

ATOL_FACTOR = 8.0


def param_name(stage: int, name: str) -> str:
    """The stable key of parameter ``name`` of stage ``stage``."""
    return f"stage{stage}.{name}"


def split(batch: Tensor, num_microbatches: int) -> tuple[Tensor, ...]:
    """m microbatches along dim 0 (torch.tensor_split: the first batch % m get one more sample)."""
    if num_microbatches < 1:
        raise ValueError(f"the number of microbatches must be at least 1, got {num_microbatches}")
    if batch.shape[0] < num_microbatches:
        raise ValueError(f"a batch of {batch.shape[0]} samples cannot be cut into {num_microbatches} microbatches")
    return torch.tensor_split(batch, num_microbatches)


@dataclass
class Dense:
    loss: Tensor  # 0-dim, the mean over microbatches of the per-microbatch loss
    grads: dict[str, Tensor]  # stable name -> dL/dparameter
    loss_atol: Tensor
    grad_atol: dict[str, Tensor]  # stable name -> 0-dim bound for every element
    microbatch_grads: list[dict[str, Tensor]]  # grad(L_k / m) per microbatch k (to name a wrong answer)


def dense_step(
    stages: list[nn.Module],
    inputs: Tensor,
    targets: Tensor,
    loss_fn,
    num_microbatches: int,
    scale_grads: bool = True,
    streams: list[int] | None = None,
    forward_orders: list[list[int]] | None = None,
) -> Dense:
    """Loss and gradients of the stages run in sequence on the whole batch. The modules' .grad
    are left alone (torch.autograd.grad). ``scale_grads=False``: L = sum_i loss_fn(output_i,
    target_i), no 1/m (a loss_fn that normalises by the global token count itself). ``streams``
    (one seed per rank): the random numbers (dropout) of a stage's forward on a microbatch are the
    ones its rank's generator, seeded with streams[r], gives at that point of the rank's forwards:
    ``forward_orders[r]`` lists the stages of rank r's forwards in the order it runs them, the k-th
    forward of a stage being microbatch k (by default one stage per rank, r = s, its forwards in
    microbatch order); the driver's generator is left as it was."""
    if streams is not None:
        orders = forward_orders if forward_orders is not None else [[s] * num_microbatches for s in range(len(stages))]
        with torch.random.fork_rng(devices=[]):
            states = _stream_states(stages, inputs, num_microbatches, streams, orders)
            return _dense_step(stages, inputs, targets, loss_fn, num_microbatches, scale_grads, states)
    return _dense_step(stages, inputs, targets, loss_fn, num_microbatches, scale_grads, None)


def _stream_states(stages, inputs, num_microbatches, streams, orders) -> dict[tuple[int, int], Tensor]:
    """(stage, microbatch) -> the generator state its forward starts from: each rank's stream run
    through its forwards in order. A dropout draws as many numbers as its input has elements, so a
    forward on zeros of the microbatch's shape at that stage advances the stream as the real one
    does (the shapes come from a first pass)."""
    shapes = {}
    with torch.no_grad():
        for i, x in enumerate(split(inputs, num_microbatches)):
            h = x
            for s, stage in enumerate(stages):
                shapes[(s, i)] = h.shape
                h = stage(h)
    states = {}
    for seed, order in zip(streams, orders):
        torch.manual_seed(seed)
        done: dict[int, int] = {}
        for s in order:
            i = done.get(s, 0)
            done[s] = i + 1
            if (s, i) not in shapes:
                raise ValueError(f"a rank's order of forwards runs stage {s} more than {num_microbatches} times")
            states[(s, i)] = torch.get_rng_state()
            with torch.no_grad():
                stages[s](torch.zeros(shapes[(s, i)], dtype=inputs.dtype))
    missing = sorted(set(shapes) - set(states))
    if missing:
        raise ValueError(f"no rank's order of forwards runs (stage, microbatch) {missing[:4]}")
    return states


def _dense_step(stages, inputs, targets, loss_fn, num_microbatches, scale_grads, states) -> Dense:
    named = [(param_name(s, n), p) for s, stage in enumerate(stages) for n, p in stage.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    m = num_microbatches
    scale = m if scale_grads else 1
    losses, per_microbatch = [], []
    for i, (x, y) in enumerate(zip(split(inputs, m), split(targets, m))):
        h = x
        for s, stage in enumerate(stages):
            if states is not None:
                torch.set_rng_state(states[(s, i)])
            h = stage(h)
        loss = loss_fn(h, y)
        grads = torch.autograd.grad(loss / scale, params, allow_unused=True)
        per_microbatch.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)])
        losses.append(loss.detach())
    dtype = params[0].dtype if params else inputs.dtype
    u = unit_roundoff(dtype) if dtype.is_floating_point else 0.0
    grads, grad_atol = {}, {}
    for k, (name, p) in enumerate(named):
        terms = [g[k] for g in per_microbatch]
        grads[name] = torch.stack(terms).sum(0)
        scale = torch.stack([t.abs() for t in terms]).sum(0).max() if p.numel() else torch.zeros((), dtype=dtype)
        grad_atol[name] = ATOL_FACTOR * (m + len(named)) * u * scale.to(torch.float64) + (
            torch.finfo(dtype).tiny if dtype.is_floating_point else 0
        )
    stacked = torch.stack(losses)
    loss_atol = ATOL_FACTOR * (m + 2) * u * stacked.abs().to(torch.float64).sum() / scale
    terms = [{name: g[k] for k, (name, _) in enumerate(named)} for g in per_microbatch]
    return Dense(stacked.mean() if scale_grads else stacked.sum(), grads, loss_atol, grad_atol, terms)
