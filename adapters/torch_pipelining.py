"""torch.distributed.pipelining through the suite's pipeline contract (CONTRACT.md, "Pipeline parallelism");
adapters/torch_native.py combines it with torch's other capabilities.

``pipeline_step`` wraps each local stage in a ``PipelineStage`` (stage index c * p + rank for the
c-th chunk) and runs ``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` on the
loss divided by m (the gradient of the mean over microbatches) with ``scale_grads=False``, as
torchtitan runs them: with ``scale_grads=True`` torch 2.13 divides every .grad of the stage by m at
the end of the step, what earlier steps accumulated included (torchtitan#1733; measured: after two
calls the gradient was 1.5 times the step's, not 2 at m = 2); "zb-v" runs ``ScheduleZBVZeroBubble`` on the V placement (stage indices r
and 2p - 1 - r). Beyond the contract's kinds, "looped-bfs", "dualpipev" and "interleaved-zb" run
torch's ScheduleLoopedBFS, ScheduleDualPipeV and ScheduleInterleavedZeroBubble (for
tests/test_torch_schedules.py). Where a public schedule class does not apply, the same stages run under
torch's schedule-IR runtime (``_PipelineScheduleRuntime``, a private API) with the schedule as
data: callable schedules, and 1F1B with fewer microbatches than stages (``Schedule1F1B`` refuses
m < p). Interleaved with v = 1 is 1F1B, as in the contract.

``generate_schedule`` takes the compute order from torch's own schedule code (GPipe's pipeline
order, the 1F1B rank-op builder ``_get_1f1b_rank_ops`` with warm-up p - 1 - r, and
``ScheduleInterleaved1F1B``'s per-rank operations) and places each receive right before the
compute that needs it and each send right after the compute that produced it. It does not use
``Schedule1F1B._get_pipeline_order`` (torch 2.13: the rank without warm-up starts at microbatch 1
and ends at m, out of range) nor torch's lowering ``_add_send_recv``, which posts a receive when
the peer sends: harmless for torch's non-blocking irecv, but under the contract's blocking
receives it adds bubbles (p=2, m=4, v=2: 2/5 instead of 1/9).

What it cannot do on gloo (raised as NotImplementedError on every rank):
* microbatches of unequal sizes (batch % m != 0): PipelineStage infers shapes from microbatch 0
  and sizes every receive buffer and gradient from it;
* per-action timestamps (``trace``);
* callable schedules that its runtime would run wrongly: the last stage's forwards out of
  microbatch order (it looks losses up by position), or messages between two ranks received in
  another order than sent (its point-to-point ops carry no tag: they match in posting order, and
  in a first try such a schedule silently delivered the wrong microbatch's activations).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble
from torch.distributed.pipelining import schedules as _ir

KINDS = ("gpipe", "1f1b", "interleaved", "zb-v")
# torch's other schedule classes, by the reference's names, beyond the contract's kinds: run by
# pipeline_step and written out by generate_schedule for tests/test_torch_schedules.py
TORCH_ONLY = {"looped-bfs": "ScheduleLoopedBFS", "dualpipev": "ScheduleDualPipeV", "interleaved-zb": "ScheduleInterleavedZeroBubble"}
ON_THE_V = ("zb-v", "dualpipev")


def _owner(p: int, placement: str):
    """stage -> rank: the loop (s % p) or the V (s for s < p, then 2p - 1 - s; torch's style "v")."""
    if placement == "v":
        return lambda stage: stage if stage < p else 2 * p - 1 - stage
    if placement != "loop":
        raise ValueError(f"unknown placement {placement!r} (known: loop, v)")
    return lambda stage: stage % p


# -------------------------------------------------------------------------------------- schedules
ZERO_BUBBLE_REFUSAL = (
    "torch.distributed.pipelining cannot run or generate ZB-H1 with one stage per rank: its "
    "zero-bubble schedule classes are ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble, "
    "several stages per rank (callable schedules with I and W run through its schedule-IR runtime)"
)


def _check(kind: str, p: int, m: int, v: int) -> None:
    if kind == "zb-h1":
        raise NotImplementedError(ZERO_BUBBLE_REFUSAL)
    if kind not in KINDS and kind not in TORCH_ONLY:
        raise ValueError(f"unknown schedule kind {kind!r} (known: {', '.join((*KINDS, *TORCH_ONLY))})")
    if kind in TORCH_ONLY and not hasattr(_ir, TORCH_ONLY[kind]):
        raise NotImplementedError(f"torch.distributed.pipelining {torch.__version__} cannot run {kind}: it has no {TORCH_ONLY[kind]}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"num_ranks, num_microbatches and stages_per_rank must be at least 1, got {p}, {m}, {v}")
    if kind in ON_THE_V and v != 2:
        raise ValueError(f"{kind} places two stages per rank in a V: stages_per_rank={v} must be 2")
    if kind == "dualpipev" and m < 2 * p:
        raise ValueError(f"DualPipeV needs at least as many microbatches as stages: m={m} < 2p={2 * p}")
    if kind == "interleaved-zb" and m % max(1, m // p):
        raise ValueError(f"torch's interleaved zero bubble needs m a multiple of its rounds max(1, m // p): m={m}, p={p}")
    if kind not in ("interleaved", "looped-bfs", "interleaved-zb", *ON_THE_V) and v != 1:
        raise ValueError(f"{kind} places one stage per rank; stages_per_rank={v} needs 'interleaved'")
    if kind == "interleaved" and m % p:
        raise ValueError(
            f"interleaved 1F1B needs the number of microbatches to be a multiple of the number of ranks: m={m} is not a multiple of p={p}"
        )


def _torch_compute_order(kind: str, p: int, m: int, v: int) -> dict[int, list]:
    if kind == "gpipe":
        order = ScheduleGPipe._get_pipeline_order(SimpleNamespace(_num_stages=p, _n_microbatches=m))
    elif kind == "1f1b" or v == 1:
        order = {}
        for r in range(p):
            warmup = min(p - 1 - r, m)
            order[r] = _ir._get_1f1b_rank_ops(1, p, warmup, m - warmup, warmup, r, lambda _: r, lambda _: r)
    elif kind in ("zb-v", *TORCH_ONLY):
        cls = ScheduleZBVZeroBubble if kind == "zb-v" else getattr(_ir, TORCH_ONLY[kind])
        state = SimpleNamespace(
            n_local_stages=v,
            pp_group_size=p,
            num_stages=p * v,
            _n_microbatches=m,
            microbatches_per_round=m // max(1, m // p),
            _stages=[None] * v,
        )
        order = {r: _ir_flat(cls._calculate_single_rank_operations(state, r)) for r in range(p)}
    else:
        state = SimpleNamespace(n_local_stages=v, pp_group_size=p, microbatches_per_round=p, _n_microbatches=m)
        order = {r: ScheduleInterleaved1F1B._calculate_single_rank_operations(state, r) for r in range(p)}
    compute = (_ir.FORWARD, _ir.FULL_BACKWARD, _ir.BACKWARD_INPUT, _ir.BACKWARD_WEIGHT)
    return {r: [a for a in order[r] if a is not None and a.computation_type in compute] for r in range(p)}


def _ir_flat(actions) -> list:
    """torch's per-rank operations with each OVERLAP_F_B pair (DualPipeV) as its forward and
    backward in order: how torch's runtime runs it on one stream, and the contract's format."""
    flat = []
    for action in actions:
        if action is not None and action.computation_type == _ir.OVERLAP_F_B:
            flat += list(action.sub_actions)
        else:
            flat.append(action)
    return flat


def generate_schedule(kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> list[list[str]]:
    """torch's compute order for ``kind``, receives right before and sends right after compute."""
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    _check(kind, p, m, v)
    last = p * v - 1
    owner = _owner(p, "v" if kind in ON_THE_V else "loop")
    rows = []
    for r, actions in sorted(_torch_compute_order(kind, p, m, v).items()):
        row = []
        for a in actions:
            s, i, kind_ = a.stage_index, a.microbatch_index, a.computation_type
            forward, gradient = kind_ == _ir.FORWARD, kind_ in (_ir.FULL_BACKWARD, _ir.BACKWARD_INPUT)
            if forward and s > 0 and owner(s - 1) != r:
                row.append(f"{s}RECV_F{i}")
            if gradient and s < last and owner(s + 1) != r:
                row.append(f"{s}RECV_B{i}")
            row.append(str(a))
            if forward and s < last and owner(s + 1) != r:
                row.append(f"{s}SEND_F{i}")
            if gradient and s > 0 and owner(s - 1) != r:
                row.append(f"{s}SEND_B{i}")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------- runtime
def _refuse_what_the_runtime_cannot_run(rows, p: int, num_stages: int, owner) -> None:
    """torch's runtime keeps the last stage's losses in a list indexed by microbatch, and its
    point-to-point ops carry no tag (messages between two ranks match in posting order)."""
    parsed = [[_ir._Action.from_str(str(text)) for text in row] for row in rows]
    last = [a.microbatch_index for row in parsed for a in row if a.stage_index == num_stages - 1 and a.computation_type == _ir.FORWARD]
    if last != sorted(last):
        raise NotImplementedError(
            f"torch.distributed.pipelining cannot run a schedule whose last stage runs its forwards out of microbatch "
            f"order ({' '.join(map(str, last))}): its runtime looks a microbatch's loss up by position"
        )
    posted: dict[tuple[int, int], list[str]] = {}
    for rank, row in enumerate(parsed):
        for a in row:
            kind = a.computation_type
            if kind in (_ir.SEND_F, _ir.SEND_B, _ir.RECV_F, _ir.RECV_B):
                peer = owner(a.stage_index + (1 if kind in (_ir.SEND_F, _ir.RECV_B) else -1))
                sending = kind in (_ir.SEND_F, _ir.SEND_B)
                pair = (rank, peer) if sending else (peer, rank)
                message = (
                    f"{a.stage_index if sending else a.stage_index + (-1 if kind == _ir.RECV_F else 1)}"
                    f"{'F' if kind in (_ir.SEND_F, _ir.RECV_F) else 'B'}{a.microbatch_index}"
                )
                posted.setdefault(pair + (int(sending),), []).append(message)
    for (src, dst, sending), sends in posted.items():
        if sending and sends != posted.get((src, dst, 0), []):
            raise NotImplementedError(
                f"torch.distributed.pipelining cannot run a schedule in which rank {dst} receives the messages of rank "
                f"{src} in another order than they are sent (sent {' '.join(sends)}, received "
                f"{' '.join(posted.get((src, dst, 0), []))}): its point-to-point ops carry no tag, so they match in "
                f"posting order and a wrong microbatch would arrive"
            )


def _refuse_messages_to_oneself(num_stages: int, owner, device: torch.device) -> None:
    """A torch whose multi-stage schedules open their links by posting one message to each
    neighbouring stage (``_get_init_p2p_neighbors_ops``, batched; torch 2.11 measured) posts a
    message from a rank to itself where two neighbouring stages share it: the turn of the V, or
    one rank holding several stages. gloo (the backend of CPU tensors here) refuses that ("Pair
    is not connected", measured on 2.11 and 2.13); newer torch opens links by a vote instead
    (``_initialize_pp_stages``). The same answer on every rank, so every rank raises."""
    shared = [s for s in range(num_stages - 1) if owner(s) == owner(s + 1)]
    if shared and device.type == "cpu" and not hasattr(_ir._PipelineSchedule, "_initialize_pp_stages"):
        raise NotImplementedError(
            f"torch.distributed.pipelining {torch.__version__} cannot run two neighbouring stages on one gloo rank "
            f"(stages {shared[0]} and {shared[0] + 1} on rank {owner(shared[0])}): it opens each link between "
            f"neighbouring stages with a message, here from a rank to itself, which gloo refuses"
        )


def _runtime(stages: list, m: int, loss_fn, rows, owner) -> _ir._PipelineScheduleRuntime:
    """torch's schedule-IR runtime on ``rows`` (compute and communication, as given; I and W are
    its BACKWARD_INPUT and BACKWARD_WEIGHT); a REDUCE_GRAD (the 1/m scaling) follows each stage's
    last backward (B, or W when split). The runtime reads the stage placement off the rows."""
    _refuse_what_the_runtime_cannot_run(rows, stages[0].group_size, stages[0].num_stages, owner)
    runtime = _ir._PipelineScheduleRuntime(stages, m, loss_fn=loss_fn, scale_grads=False)
    actions = {}
    for rank, row in enumerate(rows):
        done, out = Counter(), []
        for text in row:
            action = _ir._Action.from_str(str(text))
            out.append(action)
            if action.computation_type in (_ir.FULL_BACKWARD, _ir.BACKWARD_WEIGHT):
                done[action.stage_index] += 1
                if done[action.stage_index] == m:
                    out.append(_ir._Action(action.stage_index, _ir.REDUCE_GRAD, None))
        actions[rank] = out
    runtime._prepare_schedule_with_comms(actions, format="compute_comms")
    return runtime


def _batch_size(inputs, group, device) -> int:
    """Rank 0's batch size, on every rank (only rank 0 holds the inputs); on the stages' device
    (NCCL communicates CUDA tensors only)."""
    size = torch.tensor([inputs.shape[0] if inputs is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(size)


def pipeline_step(
    stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, trace=None, placement=None, scale_grads=True
):
    """The contract's pipeline_step on torch.distributed.pipelining (see the module docstring)."""
    if trace is not None:
        raise NotImplementedError(
            "torch.distributed.pipelining cannot report per-action timestamps (trace): its schedules run every action inside step()"
        )
    chunks = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    m, v = num_microbatches, len(chunks)
    device = next((t.device for chunk in chunks for t in chunk.parameters()), torch.device("cpu"))
    batch = _batch_size(inputs, group, device)
    if batch < m:
        raise ValueError(f"a batch of {batch} samples cannot be cut into {m} microbatches")
    if batch % m:
        raise NotImplementedError(
            f"torch.distributed.pipelining cannot run microbatches of unequal sizes on gloo (batch {batch}, m={m}): "
            f"PipelineStage infers shapes from microbatch 0 and sizes every receive buffer from it"
        )
    if placement is None:
        placement = "v" if schedule in ON_THE_V else "loop"
    owner = _owner(p, placement)
    mine = sorted(s for s in range(p * v) if owner(s) == rank)
    if len(mine) != v:
        raise ValueError(f"the {placement} placement puts {len(mine)} stages on rank {rank}; it was given {v}")
    _refuse_messages_to_oneself(p * v, owner, device)
    staged = [PipelineStage(chunk, s, p * v, device, group=group) for s, chunk in zip(mine, chunks)]
    contract_loss_fn = loss_fn

    def loss_fn(output, target):  # each microbatch's share of the mean (module docstring), or its whole loss
        return contract_loss_fn(output, target) / m if scale_grads else contract_loss_fn(output, target)

    if callable(schedule):
        runner = _runtime(staged, m, loss_fn, schedule(p, m, v), owner)
    else:
        _check(schedule, p, m, v)
        if schedule == "zb-v":
            runner = ScheduleZBVZeroBubble(staged, m, loss_fn=loss_fn, scale_grads=False)
        elif schedule in TORCH_ONLY:
            runner = getattr(_ir, TORCH_ONLY[schedule])(staged, m, loss_fn=loss_fn, scale_grads=False)
        elif schedule == "gpipe":
            runner = ScheduleGPipe(staged[0], m, loss_fn=loss_fn, scale_grads=False)
        elif (schedule == "1f1b" or v == 1) and m >= p:
            runner = Schedule1F1B(staged[0], m, loss_fn=loss_fn, scale_grads=False)
        elif schedule == "1f1b" or v == 1:  # Schedule1F1B refuses m < p; the same order as data
            runner = _runtime(staged, m, loss_fn, generate_schedule("1f1b", p, m, 1), owner)
        else:
            runner = ScheduleInterleaved1F1B(staged, m, loss_fn=loss_fn, scale_grads=False)
    holds_last = owner(p * v - 1) == rank
    losses: list = []
    kwargs = {"target": targets, "losses": losses} if holds_last else {}
    if rank == 0:
        runner.step(inputs, **kwargs)
    else:
        runner.step(**kwargs)
    if not holds_last:
        return None
    return torch.stack([loss.detach() for loss in losses]).sum()  # each divided by m when scale_grads


def split_stages(model, num_stages):
    """Not adapted: torch.distributed.pipelining splits a model by tracing it (``pipeline(module,
    mb_args, split_spec)``), which needs example inputs this contract's split does not get, and
    its stages are traced graphs, not the model's own layers."""
    raise NotImplementedError(
        "torch.distributed.pipelining cannot split a model without tracing it on example inputs "
        "(pipeline(module, mb_args, split_spec)), and its stages are traced copies of the layers"
    )
