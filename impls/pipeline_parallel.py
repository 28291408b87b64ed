"""Pipeline parallelism on torch.distributed point-to-point: a runtime that executes a schedule
given as data, and the schedules it ships (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V).

Stage s of S = p * v lives on rank s % p (rank r holds the v chunks r, r + p, ...), or in the V
(``placement="v"``, ZB-V: rank r holds stages r and 2p - 1 - r, so rank 0 holds the first and the
last). A schedule is
one list per rank of compact actions ``<stage><kind><microbatch>`` (kinds F, B, SEND_F, RECV_F,
SEND_B, RECV_B; see CONTRACT.md, "Pipeline parallelism"). The runtime walks its rank's list:

* F: run the stage on microbatch i (stage 0: the i-th slice of ``inputs``; else the activations
  received or, for a stage on the same rank, handed over locally); on the last stage also the loss
  of the microbatch, loss_fn(output, target_i).
* B: backward of that forward: on the last stage of loss_i / m (so the gradients are those of the
  mean over microbatches of the per-microbatch loss), elsewhere of the output with the gradient
  received; the gradient of the stage's input is kept for SEND_B (or handed over locally).
* I and W (zero-bubble schedules, Qi et al. 2024): the two halves of B. I computes only the gradient
  of the stage's input (``torch.autograd.grad``, keeping the graph), handed over as B's is; W then
  accumulates the stage parameters' gradients (``torch.autograd.backward(..., inputs=params)``) and
  frees the graph. The graph is walked twice here, where an operator-level split would share the
  common part; the numbers are B's.
* SEND_F / SEND_B: ``dist.isend`` (never blocks; every send is waited for at the end of the step).
  An activation goes with a small header (dtype, ndim, shape) so the receiver allocates without
  knowing the model; a gradient has the shape of the activation it answers, which the receiver
  knows. Each (boundary, microbatch, direction) has its own tag, so any order is matched exactly.
* RECV_F / RECV_B: blocking ``dist.recv``.

Because sends never block, a schedule in which every receive's send can run first (what the
reference simulator calls deadlock-free) never hangs here. GPipe: Huang et al. 2019. 1F1B:
PipeDream-Flush, Narayanan et al. 2021. Interleaved: Megatron-LM, Narayanan et al. 2021, section
2.2.2. Never imports the reference package.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["pipeline_step", "generate_schedule", "split_stages"]

KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
V_KINDS = ("zb-v",)  # two stages per rank in a V: rank r holds stages r and 2p - 1 - r
_COMPACT = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 8


# -------------------------------------------------------------------------------------- schedules
def split_stages(model: nn.Sequential, num_stages: int) -> list[nn.Sequential]:
    """The model's layers (its children, in order) cut into ``num_stages`` contiguous stages, the
    first L mod S stages one layer longer (torch.tensor_split's rule, the rule the microbatches are
    cut by), each an nn.Sequential of the model's own layer modules. Fewer layers than stages leave
    a stage empty: a ValueError naming both numbers."""
    layers = list(model.children())
    if num_stages < 1 or len(layers) < num_stages:
        raise ValueError(f"cannot split num_layers={len(layers)} into num_stages={num_stages}: every stage needs at least one layer")
    base, longer = divmod(len(layers), num_stages)
    stages, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < longer else 0)
        stages.append(nn.Sequential(*layers[start : start + size]))
        start += size
    return stages


def generate_schedule(kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> list[list[str]]:
    """The schedule ``kind`` (gpipe, 1f1b, interleaved) as one list of compact actions per rank.

    * gpipe: all m forwards, then all m backwards;
    * 1f1b: rank r runs min(p - 1 - r, m) warm-up forwards, then one forward one backward, then the
      remaining backwards;
    * interleaved (m a multiple of p): Megatron's schedule over v chunks per rank, warm-up
      min((v - 1) p + 2 (p - 1 - r), v m) virtual microbatches; v = 1 is 1f1b;
    * zb-h1: 1f1b with every backward split into I and W, rank r running the W of microbatch k - r
      after the I of microbatch k, and the deferred W passes in the cool-down (Qi et al. 2024);
    * zb-v (stages_per_rank 2, the V placement: rank r holds stages r and 2p - 1 - r): split
      backwards, at most 2p stage activations per rank, built by list scheduling at unit costs
      (Qi et al. 2024, sec. 6; see _zb_v).
    Receives come right before the compute that needs them, sends right after the compute that
    produced them; none between stages on the same rank."""
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r} (known: {', '.join(KINDS)})")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"num_ranks, num_microbatches and stages_per_rank must be at least 1, got {p}, {m}, {v}")
    if kind in V_KINDS and v != 2:
        raise ValueError(f"{kind} places two stages per rank in a V: stages_per_rank={v} must be 2")
    if kind not in ("interleaved", *V_KINDS) and v != 1:
        raise ValueError(f"{kind} places one stage per rank; stages_per_rank={v} needs 'interleaved'")
    if kind == "interleaved" and m % p:
        raise ValueError(
            f"interleaved 1F1B needs the number of microbatches to be a multiple of the number of ranks: m={m} is not a multiple of p={p}"
        )
    if kind == "gpipe":
        compute = [[(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)]
    elif kind == "zb-h1":
        compute = [_zb_h1(r, p, m) for r in range(p)]
    elif kind == "zb-v":
        compute = _zb_v(p, m)
    elif kind == "1f1b" or v == 1:
        compute = [_one_f_one_b(m, min(p - 1 - r, m), lambda k, kind, r=r: (r, kind, k)) for r in range(p)]
    else:
        compute = []
        for r in range(p):

            def virtual(k, kind, r=r):
                chunk = (k % (p * v)) // p
                return ((v - 1 - chunk if kind == "B" else chunk) * p + r, kind, (k // (p * v)) * p + k % p)

            compute.append(_one_f_one_b(v * m, min((v - 1) * p + 2 * (p - 1 - r), v * m), virtual))
    owner = _owner(p, "v" if kind in V_KINDS else "loop")
    return [_with_communication(row, r, owner, p * v) for r, row in enumerate(compute)]


def _owner(p: int, placement: str):
    """stage -> rank: the loop (s % p) or the V (s for s < p, then 2p - 1 - s)."""
    if placement == "v":
        return lambda stage: stage if stage < p else 2 * p - 1 - stage
    if placement != "loop":
        raise ValueError(f"unknown placement {placement!r} (known: loop, v)")
    return lambda stage: stage % p


def _zb_v(p: int, m: int, cap: int | None = None) -> list:
    """ZB-V's compute order, simulated at unit costs: at each time step every idle rank picks, among
    what is ready, the forward of its second stage, else an input gradient (first stage first),
    else a forward of its first stage (while it holds fewer than ``cap`` activations, default 2p:
    1F1B's p microbatches of two half-stages), else its oldest pending weight gradient; ranks that
    tie on time go in rank order."""
    cap = 2 * p if cap is None else cap
    rows = [[] for _ in range(p)]
    stages = [(r, 2 * p - 1 - r) for r in range(p)]
    done: dict[tuple, int] = {}  # (stage, kind, microbatch) -> finishing time
    nxt = {(s, k): 0 for s in range(2 * p) for k in "FI"}
    held, pending_w, clock = [0] * p, [[] for _ in range(p)], [0] * p

    def options(r):
        first, second = stages[r]
        found = []
        for rank_order, (s, kind) in enumerate(((second, "F"), (first, "I"), (second, "I"), (first, "F"))):
            i = nxt[(s, kind)]
            if i >= m or (kind == "I" and i >= nxt[(s, "F")]) or (kind == "F" and held[r] >= cap):
                continue
            need = ((s - 1, "F", i) if s > 0 else None) if kind == "F" else ((s, "F", i) if s == 2 * p - 1 else (s + 1, "I", i))
            if need is None or need in done:
                found.append((max(clock[r], done[need] if need else 0), rank_order, s, kind, i))
        if pending_w[r]:
            found.append((clock[r], 4, *pending_w[r][0]))
        return found

    for _ in range(6 * p * m):
        start, _, r, s, kind, i = min((o[0], o[1], r, *o[2:]) for r in range(p) for o in options(r))
        clock[r] = start + 1
        done[(s, kind, i)] = start + 1
        rows[r].append((s, kind, i))
        if kind == "W":
            pending_w[r].pop(0)
            held[r] -= 1
        else:
            nxt[(s, kind)] += 1
            held[r] += kind == "F"
            if kind == "I":
                pending_w[r].append((s, "W", i))
    return rows


def _zb_h1(r: int, p: int, m: int) -> list:
    warmup = min(p - 1 - r, m)
    row, deferred = [(r, "F", i) for i in range(warmup)], list(range(m))
    for k in range(warmup, m):
        row += [(r, "F", k), (r, "I", k - warmup)]
        if k - warmup >= r:
            row.append((r, "W", deferred.pop(0)))
    for k in range(m - warmup, m):
        row.append((r, "I", k))
        if deferred and deferred[0] <= k:
            row.append((r, "W", deferred.pop(0)))
    return row + [(r, "W", i) for i in deferred]


def _one_f_one_b(total: int, warmup: int, action) -> list:
    row = [action(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        row += [action(warmup + k, "F"), action(k, "B")]
    return row + [action(k, "B") for k in range(total - warmup, total)]


def _with_communication(row, rank: int, owner, num_stages: int) -> list[str]:
    out = []
    for stage, kind, i in row:
        needs_input = kind == "F" and stage > 0 and owner(stage - 1) != rank
        needs_grad = kind in ("B", "I") and stage < num_stages - 1 and owner(stage + 1) != rank
        if needs_input or needs_grad:
            out.append(f"{stage}{'RECV_F' if kind == 'F' else 'RECV_B'}{i}")
        out.append(f"{stage}{kind}{i}")
        if kind == "F" and stage < num_stages - 1 and owner(stage + 1) != rank:
            out.append(f"{stage}SEND_F{i}")
        if kind in ("B", "I") and stage > 0 and owner(stage - 1) != rank:
            out.append(f"{stage}SEND_B{i}")
    return out


def _parse(text) -> tuple[int, str, int]:
    match = _COMPACT.match(str(text).strip())
    if match is None:
        raise ValueError(f"{text!r} is not a compact action <stage><kind><microbatch> (e.g. '0F3', '2SEND_B1')")
    return int(match[1]), match[2], int(match[3])


def _my_actions(schedule, p: int, rank: int, m: int, v: int, owner) -> list[tuple[int, str, int]]:
    if isinstance(schedule, str):
        rows = generate_schedule(schedule, p, m, v)
    elif callable(schedule):
        rows = schedule(p, m, v)
    else:
        raise TypeError(
            f"schedule must be one of {', '.join(KINDS)} or a callable "
            f"(num_ranks, num_microbatches, stages_per_rank) -> rows, got {type(schedule).__name__}"
        )
    if len(rows) != p:
        raise ValueError(f"the schedule has {len(rows)} rows for {p} ranks")
    mine = [_parse(a) for a in rows[rank]]
    local = {s for s in range(p * v) if owner(s) == rank}
    every = sorted((s, i) for s in local for i in range(m))
    whole = sorted((s, i) for s, k, i in mine if k == "B")
    halves = [sorted((s, i) for s, k, i in mine if k == kind) for kind in ("I", "W")]
    if sorted((s, i) for s, k, i in mine if k == "F") != every or halves[0] != halves[1] or sorted(whole + halves[0]) != every:
        raise ValueError(
            f"rank {rank}'s schedule must run F exactly once and a backward (B, or I then W) exactly once "
            f"for each of its stages {sorted(local)} and microbatches 0..{m - 1}: "
            f"{list(map(str, rows[rank]))}"
        )
    return mine


# ---------------------------------------------------------------------------------------- runtime
class _Peers:
    def __init__(self, group, owner, m: int):
        self.group, self.owner, self.m = group, owner, m
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []

    def global_rank(self, stage: int) -> int:
        rank = self.owner(stage)
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def tag(self, boundary: int, microbatch: int, backward: bool, header: bool = False) -> int:
        return (((boundary * self.m + microbatch) * 2 + int(backward)) * 2 + int(header)) + 1

    def send(self, tensor: torch.Tensor, to_stage: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        self.pending.append((dist.isend(tensor, self.global_rank(to_stage), group=self.group, tag=tag), tensor))

    def recv(self, tensor: torch.Tensor, from_stage: int, tag: int) -> torch.Tensor:
        dist.recv(tensor, self.global_rank(from_stage), group=self.group, tag=tag)
        return tensor

    def send_activation(self, y: torch.Tensor, stage: int, microbatch: int) -> None:
        if y.dim() > _MAX_DIMS:
            raise ValueError(f"activations of more than {_MAX_DIMS} dimensions are not supported")
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(y.dtype), y.dim()
        header[2 : 2 + y.dim()] = torch.tensor(y.shape, dtype=torch.int64)
        self.send(header.to(y.device), stage + 1, self.tag(stage, microbatch, False, header=True))
        self.send(y, stage + 1, self.tag(stage, microbatch, False))

    def recv_activation(self, stage: int, microbatch: int, device) -> torch.Tensor:
        header = self.recv(
            torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device), stage - 1, self.tag(stage - 1, microbatch, False, header=True)
        ).cpu()
        shape = tuple(int(d) for d in header[2 : 2 + int(header[1])])
        buffer = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=device)
        return self.recv(buffer, stage - 1, self.tag(stage - 1, microbatch, False))

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def pipeline_step(
    stages,
    inputs,
    targets,
    loss_fn: Callable,
    num_microbatches: int,
    schedule="1f1b",
    group=None,
    trace: list | None = None,
    placement: str | None = None,
    scale_grads: bool = True,
):
    """One forward and backward of a batch through the pipeline; see CONTRACT.md, "Pipeline parallelism".

    ``stages``: this rank's stage module, or its v chunks in stage order (stages r, r + p, ...;
    in the V, ``placement="v"`` or schedule "zb-v", stages r and 2p - 1 - r).
    ``inputs``: the whole batch on rank 0 (None elsewhere); ``targets``: on the rank holding the
    last stage (rank p - 1; rank 0 in the V), None elsewhere; both cut into m microbatches by
    torch.tensor_split.
    ``schedule``: "gpipe", "1f1b", "interleaved", or a callable (num_ranks, num_microbatches,
    stages_per_rank) -> one list of compact actions per rank. Gradients of
    (1/m) sum_i loss_fn(output_i, target_i) are accumulated into every stage parameter's .grad;
    the rank holding the last stage returns that loss (0-dim, detached), the others None. With
    ``scale_grads=False`` (torch's name) the loss is the sum over microbatches, no 1/m: for a
    loss_fn that normalises by the global token count itself. With ``trace`` a list, (action,
    start, end) in time.perf_counter seconds is appended per action."""
    chunks = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    p = dist.get_world_size(group)
    rank = dist.get_rank(group)
    m, v = num_microbatches, len(chunks)
    scale = m if scale_grads else 1
    last = p * v - 1
    if placement is None:
        placement = "v" if schedule in V_KINDS else "loop"
    if placement == "v" and v != 2:
        raise ValueError(f"the V placement holds two stages per rank; this rank was given {v}")
    owner = _owner(p, placement)
    mine = _my_actions(schedule, p, rank, m, v, owner)
    module = dict(zip(sorted(s for s in range(p * v) if owner(s) == rank), chunks))
    device = next((t.device for chunk in chunks for t in chunk.parameters()), torch.device("cpu"))
    x_mb = torch.tensor_split(inputs, m) if 0 in module else None
    y_mb = torch.tensor_split(targets, m) if last in module else None
    if x_mb is not None and inputs.shape[0] < m:
        raise ValueError(f"a batch of {inputs.shape[0]} samples cannot be cut into {m} microbatches")
    peers = _Peers(group, owner, m)
    stage_input, stage_output, output_grad, input_grad, losses, weight_pending = {}, {}, {}, {}, {}, {}
    local = lambda stage: owner(stage) == rank

    for stage, kind, i in mine:
        started = time.perf_counter()
        key = (stage, i)
        if kind == "F":
            x = x_mb[i] if stage == 0 else stage_input[key]
            with torch.enable_grad():
                y = module[stage](x)
                if stage == last:
                    y = loss_fn(y, y_mb[i])
                    losses[i] = y.detach()
            stage_output[key] = y
            if stage < last and local(stage + 1):
                stage_input[(stage + 1, i)] = y.detach().requires_grad_()
        elif kind == "B":
            y = stage_output.pop(key)
            if stage == last:
                (y / scale).backward()
            else:
                torch.autograd.backward(y, output_grad.pop(key))
            if stage > 0:
                x = stage_input.pop(key)
                g = x.grad if x.grad is not None else torch.zeros_like(x)
                if local(stage - 1):
                    output_grad[(stage - 1, i)] = g
                else:
                    input_grad[key] = g
        elif kind == "I":
            y = stage_output.pop(key)
            target, grad = (y / scale, None) if stage == last else (y, output_grad.pop(key))
            weight_pending[key] = (target, grad)
            if stage > 0:
                x = stage_input.pop(key)
                (g,) = torch.autograd.grad(target, [x], grad, retain_graph=True, allow_unused=True)
                g = g if g is not None else torch.zeros_like(x)
                if local(stage - 1):
                    output_grad[(stage - 1, i)] = g
                else:
                    input_grad[key] = g
        elif kind == "W":
            target, grad = weight_pending.pop(key)
            params = [t for t in module[stage].parameters() if t.requires_grad]
            if params and target.requires_grad:
                torch.autograd.backward(target, grad, inputs=params)
        elif kind == "SEND_F":
            peers.send_activation(stage_output[key].detach(), stage, i)
        elif kind == "RECV_F":
            stage_input[key] = peers.recv_activation(stage, i, device).requires_grad_()
        elif kind == "SEND_B":
            peers.send(input_grad.pop(key), stage - 1, peers.tag(stage - 1, i, True))
        else:  # RECV_B
            y = stage_output[key]
            output_grad[key] = peers.recv(torch.empty_like(y), stage + 1, peers.tag(stage, i, True))
        if trace is not None:
            trace.append((f"{stage}{kind}{i}", started, time.perf_counter()))
    peers.wait_all()
    if last not in module:
        return None
    total = torch.stack([losses[i] for i in range(m)])
    return total.mean() if scale_grads else total.sum()
