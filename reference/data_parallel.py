"""Single-process truth for data parallelism: k optimizer steps on the whole global batch.

Data parallelism on n ranks: rank r keeps the whole model and takes rows [r B/n, (r+1) B/n) of a
global batch of B samples; its loss L_r is the mean over its B/n samples; after backward the
gradients are averaged over ranks, g = (1/n) sum_r grad L_r; every rank applies the same update.
With equal slices, (1/n) sum_r L_r = (1/B) sum_i l_i = L, the loss of the global batch, so

    g = (1/n) sum_r grad L_r = grad L,

and n ranks that start from rank 0's state follow exactly the trajectory of one process training
on the global batch, which is what ``train`` computes. With gradient accumulation over k
micro-steps (k global micro-batches per optimizer step, each split across the ranks, backward after
each, gradients summed in .grad), the same identity holds term by term:
(1/n) sum_r sum_j grad L_rj = sum_j grad L_j (up to rounding: the sums are taken in a
different order; see the tolerances at the end). Torch semantics throughout: a parameter that no
forward touched keeps .grad None after zero_grad(set_to_none=True) and the optimizer skips it (no
momentum, no weight decay); a frozen parameter (requires_grad=False) never changes.

Never imports torch.distributed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from parallelism_conformance.reference.tolerance import unit_roundoff

# C in the tolerances (grad_atol, loss_atol, param_atol); see there.
IGNORE = -100  # a target that is not a token: torch's cross_entropy ignore_index
ATOL_FACTOR = 512


@dataclass
class Trajectory:
    """What one process training on the global batch goes through, step s = 0 .. k-1."""

    initial: dict[str, Tensor]  # every parameter and buffer before the first step
    states: list[dict[str, Tensor]]  # every parameter and buffer after step s
    grads: list[dict[str, Tensor]]  # the gradient step s applied, for parameters that had one
    losses: list[Tensor]  # the global-batch loss at step s (the state before the step)
    optimizer_state: list[dict[str, int]]  # after step s: {parameter: elements of its optimizer state}
    norms: list[Tensor] = field(default_factory=list)  # with clipping: the total gradient norm at step s
    micro_batch_scale: float = 1.0  # each micro-batch's loss was multiplied by this before its backward (``train``)


@dataclass
class Evaluation:
    """One step's truth at a given state: each rank's slice loss and the gradient the ranks must
    hold after synchronization, with the magnitudes of its summands for the tolerance."""

    grads: dict[str, Tensor]  # (1/n) sum_r sum_j grad L_rj = sum_j grad L_j, for parameters with a .grad
    slice_losses: list[Tensor]  # per rank r, the losses L_rj of its slice of each micro-batch j, shape (k,)
    slice_grad_means: dict[str, Tensor]  # (1/n) sum_r sum_j |grad L_rj|, elementwise
    slice_grads: list[dict[str, Tensor]]  # sum_j grad L_rj per rank r (to name a wrong answer: reference/likely_bugs.py)


def split_batch(batch: dict[str, Tensor], world_size: int) -> list[dict[str, Tensor]]:
    """Rank r's slice of a global batch: rows [r B/n, (r+1) B/n) of every tensor. Raises ValueError
    when B is not a multiple of n: the mean of per-rank mean losses is the global mean only when
    the slices are equal."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    sizes = {name: t.shape[0] for name, t in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"the tensors of a batch must share their first (batch) dimension, got {sizes}")
    total = next(iter(sizes.values()))
    if total % world_size:
        raise ValueError(
            f"a global batch of {total} samples does not split evenly across world size {world_size} "
            f"({total} % {world_size} = {total % world_size}): data parallelism needs equal per-rank "
            f"slices for the mean of per-rank mean losses to be the global-batch mean"
        )
    each = total // world_size
    return [{name: t[r * each : (r + 1) * each] for name, t in batch.items()} for r in range(world_size)]


def split_micro_batches(batch: dict[str, Tensor], micro_batches: int) -> list[dict[str, Tensor]]:
    """The k global micro-batches of one optimizer step under gradient accumulation: k equal blocks
    of rows, in order (each then split across ranks by ``split_batch``)."""
    return split_batch(batch, micro_batches)


def optimizer(spec: dict, params) -> torch.optim.Optimizer:
    """``{"name": "sgd", "lr", "momentum", "weight_decay"}``: torch.optim.SGD;
    ``{"name": "adamw", "lr", "betas", "eps", "weight_decay"}``: torch.optim.AdamW."""
    kwargs = {k: (tuple(v) if k == "betas" else v) for k, v in spec.items() if k != "name"}
    classes = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
    if spec["name"] not in classes:
        raise ValueError(f"unknown optimizer {spec['name']!r} (known: {', '.join(classes)})")
    return classes[spec["name"]](params, **kwargs)


def state(model: nn.Module) -> dict[str, Tensor]:
    """{name: copy} of every parameter (a tied one once, under its first name) and buffer."""
    return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def train(
    model: nn.Module,
    optimizer_spec: dict,
    batch: dict[str, Tensor],
    steps: int,
    micro_batches: int = 1,
    set_to_none: bool = True,
    clip: dict | None = None,
    per_token: bool = False,
    unused_get_zero_grad: bool = False,
    micro_batch_scale: float = 1.0,
) -> Trajectory:
    """``steps`` optimizer steps of ``model`` (trained in place) on the whole ``batch``:
    zero_grad(set_to_none); for each of the ``micro_batches`` global micro-batches, loss =
    model(inputs, targets), its mean, and loss.backward() (gradients accumulate); optimizer.step().
    With set_to_none=False a parameter keeps a zero .grad once it has had one, and the optimizer
    then steps it (momentum, weight decay) like any other. ``clip`` ({"max_norm", "norm_type"}):
    the gradients are clipped before every step (``clip_gradients``). ``per_token``: the model
    returns the sum of its per-token losses, and each micro-batch's is divided by the step's count
    of valid targets (reference/token_loss.py). ``unused_get_zero_grad``: a trainable parameter no
    forward used gets a zero gradient each step and is stepped like any other (weight decay,
    momentum): not the contract's semantics but a documented design of some libraries (DeepSpeed
    reduces a zero gradient for it so every rank reduces the same sizes), judged apart as "differs
    by design" (conformance/by_design.py). ``micro_batch_scale`` s: each micro-batch's backward is
    of s L_j (the step's gradient s sum_j grad L_j: 1/k averages the k micro-batches, as a library
    that divides each loss by its own count of them does); the losses recorded are the L_j."""
    opt = optimizer(optimizer_spec, model.parameters())
    trajectory = Trajectory(state(model), [], [], [], [], micro_batch_scale=micro_batch_scale)
    scale = 1.0 / valid_targets(batch) if per_token else 1.0
    for _ in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        for micro in split_micro_batches(batch, micro_batches):
            loss = model(micro["inputs"], micro["targets"]) * scale
            (loss * micro_batch_scale if micro_batch_scale != 1.0 else loss).backward()
        for p in model.parameters() if unused_get_zero_grad else ():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        trajectory.grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None})
        if clip is not None:
            trajectory.norms.append(clip_gradients(model, clip["max_norm"], clip["norm_type"]))
        opt.step()
        trajectory.losses.append(loss.detach())
        trajectory.states.append(state(model))
        trajectory.optimizer_state.append(optimizer_state_numel(opt, model))
    return trajectory


def valid_targets(batch: dict[str, Tensor]) -> int:
    """The number of targets that are tokens: every one but ``IGNORE`` (torch's ignore_index)."""
    return int((batch["targets"] != IGNORE).sum())


def total_norm(grads: list[Tensor], norm_type: float) -> Tensor:
    """The norm of all gradients as one vector: (sum_p sum_e |g_pe|^q)^(1/q), or max_pe |g_pe| for
    q = inf (what torch.nn.utils.clip_grad_norm_ returns), in float64. A tied parameter is one
    parameter: its gradient counts once."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    flat = torch.cat([g.detach().double().reshape(-1) for g in grads])
    return torch.linalg.vector_norm(flat, norm_type)


def clip_gradients(model: nn.Module, max_norm: float, norm_type: float) -> Tensor:
    """torch.nn.utils.clip_grad_norm_'s rule, written out: with N = ``total_norm`` of every .grad,
    each gradient is multiplied by min(1, max_norm / (N + 1e-6)). Returns N (float64)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = total_norm(grads, norm_type)
    coefficient = min(1.0, max_norm / (float(norm) + 1e-6))
    with torch.no_grad():
        for g in grads:
            g.mul_(coefficient)
    return norm


def optimizer_state_numel(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, int]:
    """{parameter name: elements of the state ``opt`` keeps for it}, counting the state tensors
    shaped like their parameter (SGD's momentum buffer; AdamW's two moments), not scalar step
    counters. torch creates a parameter's state at its first step with a gradient, so a frozen
    parameter, or one no forward has used yet, has none. What one process holds; ZeRO stage 1
    (Rajbhandari et al., 2020, sec. 5.1) splits exactly this across the n ranks."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: sum(v.numel() for v in st.values() if torch.is_tensor(v) and v.shape == p.shape) for p, st in opt.state.items() if st}


def load_state(model: nn.Module, values: dict[str, Tensor]) -> nn.Module:
    """Copy ``values`` ({name: tensor}, as ``state`` returns them) into ``model``'s parameters and
    buffers, in place; every name of ``state(model)`` must be there."""
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            tensor.copy_(values[name])
    return model


def evaluate(
    model: nn.Module,
    batch: dict[str, Tensor],
    world_size: int,
    micro_batches: int = 1,
    had_grad: frozenset = frozenset(),
    device: str = "cpu",
    micro_batch_scale: float = 1.0,
) -> Evaluation:
    """The next step at ``model``'s current state (on copies: ``model``, buffers included, is left
    alone): the loss L_r and gradient grad L_r of each rank's slice, and their mean over ranks
    (1/n) sum_r grad L_r, summed in rank order. That mean is the global-batch gradient grad L (the
    identity in the module docstring); it is computed from the slices because then the ranks' own
    backward passes (same slices, same shapes) are the same computation, and only the n-term
    average is rounded differently, which ``grad_atol`` bounds tightly. One backward over the whole
    batch rounds the per-sample chain rule differently (other kernel shapes), by an amount that
    cancellation inside a sample's gradient can make large relative to the result; ``train``
    follows it, and ``param_atol`` covers that.

    Under gradient accumulation (``micro_batches`` = k > 1) each rank runs its slices of the k
    micro-batches one after the other on one replica (a buffer such as a call counter advances as
    on the rank). ``had_grad``: the parameters that already hold a .grad when the step starts
    (zero_grad(set_to_none=False) keeps them, as zeros): they end the step with one even if no
    forward of this step used them.

    ``device``: where each slice's forward and backward run ("cuda" when the ranks compute on
    GPUs): the same kernels as the ranks', so that the identity above holds to the last bit there
    too; the results come back to the CPU, where the average is taken. ``micro_batch_scale``: as
    in ``train`` (each micro-batch's gradient is that of s L_j)."""
    micro = split_micro_batches(batch, micro_batches)
    per_rank = [_losses_and_grads(model, [split_batch(b, world_size)[r] for b in micro], device, micro_batch_scale) for r in range(world_size)]
    losses = [torch.stack(rank_losses) for rank_losses, _ in per_rank]
    terms = [rank_terms for _, rank_terms in per_rank]  # terms[r][j]: {name: grad L_rj}
    used = [[name for name, _ in model.named_parameters() if any(name in t for t in rank_terms)] for rank_terms in terms]
    if any(u != used[0] for u in used):
        raise ValueError(f"the slices use different parameters (data-dependent control flow): {used}")
    shapes = dict(model.named_parameters())
    names = [name for name, p in model.named_parameters() if name in used[0] or name in had_grad and p.requires_grad]
    n = world_size

    def total(r, name, magnitude=False):
        pieces = [t[name].abs() if magnitude else t[name] for t in terms[r] if name in t]
        return _sum(pieces) if pieces else torch.zeros_like(shapes[name])

    slice_grads = [{name: total(r, name) for name in names} for r in range(n)]
    return Evaluation(
        grads={name: _sum(g[name] for g in slice_grads) / n for name in names},
        slice_losses=losses,
        slice_grad_means={name: _sum(total(r, name, magnitude=True) for r in range(n)) / n for name in names},
        slice_grads=slice_grads,
    )


def _sum(tensors):
    tensors = iter(tensors)
    total = next(tensors).clone()
    for t in tensors:
        total += t
    return total


def _losses_and_grads(
    model: nn.Module, batches: list[dict[str, Tensor]], device: str = "cpu", scale: float = 1.0
) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    """One copy of ``model`` (the model itself is left alone) run on ``batches`` in order, on
    ``device``: each batch's loss and the gradients of that loss alone (of ``scale`` times it), back on the CPU."""
    replica = copy.deepcopy(model).to(device)
    named = [(name, p) for name, p in replica.named_parameters() if p.requires_grad]
    losses, grads = [], []
    for batch in batches:
        loss = replica(batch["inputs"].to(device), batch["targets"].to(device))
        found = torch.autograd.grad(loss * scale if scale != 1.0 else loss, [p for _, p in named], allow_unused=True)
        losses.append(loss.detach().cpu())
        grads.append({name: g.cpu() for (name, _), g in zip(named, found) if g is not None})
    return losses, grads


# ------------------------------------------------------------------------------------ tolerances
# The ranks compute the same quantities as one process in another order. Recursive summation of
# m terms errs by at most (m - 1) u sum|terms| (Higham, 2nd ed., §4.2), so the bounds scale the
# unit roundoff u by the magnitudes of the summands, not of the (possibly cancelled) result, taken
# normwise (the largest over the tensor). C = ATOL_FACTOR = 512 (256 eps) covers the length of the
# sums and, for parameters, the propagation through the optimizer and the next steps' gradients.
# AdamW's update g / (sqrt(v) + eps) amplifies a gradient error by up to 1/(4 eps) where |g| is near
# eps, which is why the suite's AdamW uses eps = 1e-3. Measured over thousands of drawn examples,
# correct implementations (the bundled ones, torch's DDP) stay below C/50. The bugs the bounds must
# not hide (summing instead of averaging, a missed or extra gradient, a missing broadcast) are
# orders of magnitude larger.


def grad_atol(evaluation: Evaluation, name: str) -> Tensor:
    """The synchronized gradient of ``name`` against ``evaluation.grads[name]`` (same state):
    C u max_e (1/n) sum_r |grad L_r|_e, the summands of the average over ranks."""
    means = evaluation.slice_grad_means[name]
    return _bound(float(means.max()), means.dtype)


def loss_atol(evaluation: Evaluation, rank: int) -> Tensor:
    """Rank ``rank``'s slice losses L_rj, from the same state: C u max_j |L_rj| (each a mean of
    non-negative per-sample losses: no cancellation in the sum)."""
    losses = evaluation.slice_losses[rank]
    return _bound(float(losses.abs().max()), losses.dtype)


def param_atol(trajectory: Trajectory, step: int, name: str) -> Tensor:
    """Parameter ``name`` after ``step`` steps (1-based), the trajectory's errors adding up step by
    step: C u step max_{0 <= j <= step} max_e |p_j,e|, the largest magnitude it has had."""
    history = [trajectory.initial[name], *(s[name] for s in trajectory.states[:step])]
    return _bound(step * max(float(p.abs().max()) for p in history), history[0].dtype)


def _bound(magnitude: float, dtype: torch.dtype) -> Tensor:
    return torch.tensor(ATOL_FACTOR * unit_roundoff(dtype) * magnitude + torch.finfo(dtype).tiny, dtype=torch.float64)
