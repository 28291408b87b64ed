"""Pipeline schedules as data: the format, the generators, a validator, a grid.

A pipeline of S = p * v stages runs on p ranks; stage s lives on rank s % p (the "loop" placement;
v = 1: stage s on rank s; v > 1: Megatron's interleaving, rank r holds stages r, r + p, r + 2p, ...)
or, for ZB-V, on the "v" placement (v = 2: rank r holds stages r and 2p - 1 - r). A batch is cut
into m microbatches. A schedule is, for each rank, the ordered list of what it does:

* ``F``: forward of microbatch i on stage s;  ``B``: backward of microbatch i on stage s;
* ``I`` and ``W``: the two halves of a backward, as torch.distributed.pipelining names them and as
  zero-bubble pipelines split it (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): ``I``
  computes the gradient of the stage's input (on the critical path: the previous stage waits for
  it), ``W`` the gradients of the stage's weights (needed by nobody until the optimizer step, so it
  can be deferred to fill bubbles). A stage's backward of a microbatch is either one ``B`` or an
  ``I`` followed later by its ``W``;
* ``SEND_F`` (stage s sends the activations of microbatch i to stage s + 1), ``RECV_F`` (stage s
  receives them from stage s - 1), ``SEND_B`` (stage s sends the gradient of its input for
  microbatch i to stage s - 1), ``RECV_B`` (stage s receives the gradient of its output from stage
  s + 1). The peer stage is implied by the kind (``Action.peer_stage``); a transfer between two
  stages on the same rank (only when p = 1) is local and has no send or receive.

Compact form (torch.distributed.pipelining's convention): ``<stage><kind><microbatch>``, e.g.
``0F3`` = stage 0 forward of microbatch 3, ``2SEND_B1`` = stage 2 sends the gradient of
microbatch 1 to stage 1, ``3RECV_F0`` = stage 3 receives the activations of microbatch 0 from
stage 2. A schedule travels as plain data: one list of compact strings per rank.

Generators (communication inserted by ``add_communication``: each receive right before the compute
that needs it, each send right after the compute that produced it):

* GPipe (Huang et al. 2019): every rank runs all m forwards, then all m backwards (in the same
  microbatch order). Bubble fraction (p - 1) / (m + p - 1); m activations live at once.
* 1F1B, PipeDream-Flush (Narayanan et al. 2021): rank r runs min(p - 1 - r, m) warm-up forwards,
  then alternates one forward and one backward, then drains the remaining backwards. Same bubble
  as GPipe, but rank r holds at most min(m, p - r) live activations.
* ZB-H1 (Qi et al. 2024, section 3.1): 1F1B's warm-up and steady state with every backward split
  into I and W, rank r deferring its W passes by r microbatches (its steady state runs F, I, then
  the W of r microbatches earlier; the deferred W passes fill the cool-down). Rank r then holds at
  most min(m, p) activations (freed at W), 1F1B's peak, and with T_W <= T_F and T_W <= T_I the
  bubble is (p - 1)(T_F + T_I - T_W) per rank for m >= p: a third of 1F1B's when T_F = T_I = T_W.
* Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021, section 2.2.2), v stages per rank, m a
  multiple of p: rank r runs virtual microbatches k = 0 .. v*m - 1; forward k is stage
  ((k mod pv) div p) * p + r on microbatch (k div pv) * p + k mod p; backward k walks the chunks in
  reverse. Warm-up: min((v - 1) p + 2 (p - 1 - r), v m) forwards, then 1F1B, then cool-down. With
  per-chunk times t_f, t_b (a chunk is 1/v of a rank's layers) the bubble is (p - 1)(t_f + t_b)
  against an ideal v m (t_f + t_b): fraction (p - 1) / (v m + p - 1), v times smaller than 1F1B's.
  With v = 1 it is plain 1F1B (as in Megatron, which dispatches v = 1 to the non-interleaved
  schedule).
* ZB-H2 (Qi et al. 2024, sec. 2.2), ZB-V (sec. 6, the V placement), DualPipeV (DeepSeek-V3, on the
  V) and looped BFS (Lamy-Poirier 2023): see their generators; ZB-H2 and ZB-V are built by list scheduling at unit costs
  (``list_scheduled``), as the paper builds its heuristic schedules.

The validator raises ScheduleError naming the rank, the step, the action and the rule broken, with
the step grid (ranks as rows, steps as columns) and the bad action in brackets. Timing, bubbles,
memory and deadlocks are in reference/pipeline_simulator.py. Pure Python; no torch at all.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

F, B, I, W = "F", "B", "I", "W"  # noqa: E741 - the zero-bubble paper's names of the four passes
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, I, W)
BACKWARD_INPUT = (B, I)  # what produces the gradient a stage sends to the previous one
RELEASES = (B, W)  # what frees a microbatch's activations on its stage
COMMUNICATION = (SEND_F, RECV_F, SEND_B, RECV_B)
LOOP, V_SHAPE = "loop", "v"  # stage placements (stage_rank)
PLACEMENTS = (LOOP, V_SHAPE)
KINDS = ("gpipe", "1f1b", "interleaved")  # the capability pipeline_parallel
ZERO_BUBBLE_KINDS = ("zb-h1",)  # the capability zero_bubble: backward split into I and W
V_SHAPE_KINDS = ("zb-v",)  # the capability zero_bubble_v: two stages per rank on the V-shaped placement
ALL_KINDS = (*KINDS, *ZERO_BUBBLE_KINDS, *V_SHAPE_KINDS)
# generated, validated and simulated here, and run on ranks as callable schedules (their rows), not
# asked of an implementation's generate_schedule
REFERENCE_ONLY_KINDS = ("zb-h2", "looped-bfs", "dualpipev")
ON_THE_V = ("zb-v", "dualpipev")  # the kinds placed on the V (placement_of)

_COMPACT = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_PEER_OFFSET = {SEND_F: +1, RECV_F: -1, SEND_B: -1, RECV_B: +1}
# The send that a receive waits for, and the receive that a send feeds: (kind, stage offset).
_MATCH = {RECV_F: (SEND_F, -1), SEND_F: (RECV_F, +1), RECV_B: (SEND_B, +1), SEND_B: (RECV_B, -1)}


class Action(NamedTuple):
    stage: int
    kind: str  # F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @property
    def peer_stage(self) -> int | None:
        """The stage at the other end of a send or receive; None for compute."""
        offset = _PEER_OFFSET.get(self.kind)
        return None if offset is None else self.stage + offset

    def matching(self) -> Action:
        """The receive a send feeds, or the send a receive waits for."""
        kind, offset = _MATCH[self.kind]
        return Action(self.stage + offset, kind, self.microbatch)

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _COMPACT.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"{text!r} is not an action in compact form <stage><kind><microbatch> with kind one of "
                             f"{', '.join((*COMPUTE, *COMMUNICATION))} (e.g. '0F3', '2SEND_B1')")
        return cls(int(match[1]), match[2], int(match[3]))


def stage_rank(stage: int, num_ranks: int, placement: str = LOOP) -> int:
    """The rank stage ``stage`` lives on: ``"loop"`` s % p (v = 1: stage s on rank s; Megatron's
    interleaving for v > 1); ``"v"`` (two stages per rank, the V shape of ZB-V and DualPipeV, Qi et
    al. 2024 sec. 6): s for s < p, then back down, 2p - 1 - s, so rank 0 holds the first and the
    last stage."""
    if placement == V_SHAPE:
        return stage if stage < num_ranks else 2 * num_ranks - 1 - stage
    return stage % num_ranks


def rank_stages(rank: int, num_ranks: int, num_stages: int, placement: str = LOOP) -> list[int]:
    """The stages rank ``rank`` holds, in stage order (its chunks, as ``pipeline_step`` takes them)."""
    return [s for s in range(num_stages) if stage_rank(s, num_ranks, placement) == rank]


@dataclass(frozen=True)
class Schedule:
    """What each of ``num_ranks`` ranks does, in order. Stage s lives on rank ``stage_rank(s, p,
    placement)``: s % p (``"loop"``) or the V shape (``"v"``, two stages per rank)."""

    num_ranks: int
    num_stages: int
    num_microbatches: int
    rows: tuple[tuple[Action, ...], ...]
    placement: str = LOOP

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.num_ranks, self.placement)

    def stages_of(self, rank: int) -> list[int]:
        return rank_stages(rank, self.num_ranks, self.num_stages, self.placement)

    def to_strings(self) -> list[list[str]]:
        return [[str(a) for a in row] for row in self.rows]

    def compute_only(self) -> Schedule:
        return self.with_rows(tuple(a for a in row if a.is_compute) for row in self.rows)

    def with_rows(self, rows) -> Schedule:
        return Schedule(self.num_ranks, self.num_stages, self.num_microbatches, tuple(tuple(r) for r in rows),
                        self.placement)

    @classmethod
    def from_strings(cls, rows, num_microbatches: int, stages_per_rank: int = 1, placement: str = LOOP) -> Schedule:
        """A schedule from plain data: one list of compact strings per rank (what a rank returns)."""
        if not isinstance(rows, (list, tuple)) or not all(isinstance(row, (list, tuple)) for row in rows):
            raise ValueError(f"a schedule is one list of compact action strings per rank, got {type(rows).__name__}")
        parsed = tuple(tuple(Action.parse(text) for text in row) for row in rows)
        return cls(len(parsed), len(parsed) * stages_per_rank, num_microbatches, parsed, placement)

    def __str__(self) -> str:
        return render_grid(self)


class ScheduleError(ValueError):
    """A malformed schedule. ``rank``, ``step`` (None for a missing action), ``action`` and
    ``rule`` say where and why; the message shows the grid with the bad action in brackets."""

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None,
                 action: Action | None = None, rule: str = ""):
        super().__init__(message)
        self.rank, self.step, self.action, self.rule = rank, step, action, rule


# -------------------------------------------------------------------------------------- generators
def check_arguments(kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> None:
    """The ValueError a generator raises for arguments it cannot schedule."""
    if kind not in (*ALL_KINDS, *REFERENCE_ONLY_KINDS):
        raise ValueError(f"unknown schedule kind {kind!r} (known: {', '.join((*ALL_KINDS, *REFERENCE_ONLY_KINDS))})")
    if num_ranks < 1 or num_microbatches < 1 or stages_per_rank < 1:
        raise ValueError(f"num_ranks, num_microbatches and stages_per_rank must be at least 1, got "
                         f"{num_ranks}, {num_microbatches}, {stages_per_rank}")
    if kind in ON_THE_V and stages_per_rank != 2:
        raise ValueError(f"{kind} places two stages per rank in a V; stages_per_rank={stages_per_rank} must be 2")
    if kind == "dualpipev" and num_microbatches < 2 * num_ranks:
        raise ValueError(f"DualPipeV needs at least as many microbatches as stages: m={num_microbatches} < 2p="
                         f"{2 * num_ranks}")
    if kind not in ("interleaved", "looped-bfs", *ON_THE_V) and stages_per_rank != 1:
        raise ValueError(f"{kind} places one stage per rank; stages_per_rank={stages_per_rank} needs 'interleaved'")
    if kind == "interleaved" and num_microbatches % num_ranks:
        raise ValueError(f"interleaved 1F1B needs the number of microbatches to be a multiple of the number of "
                         f"ranks: m={num_microbatches} is not a multiple of p={num_ranks}")


def gpipe_compute(p: int, m: int) -> list[list[Action]]:
    return [[Action(r, F, i) for i in range(m)] + [Action(r, B, i) for i in range(m)] for r in range(p)]


def one_f_one_b_compute(p: int, m: int) -> list[list[Action]]:
    rows = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        row = [Action(r, F, i) for i in range(warmup)]
        for k in range(m - warmup):
            row += [Action(r, F, warmup + k), Action(r, B, k)]
        row += [Action(r, B, k) for k in range(m - warmup, m)]
        rows.append(row)
    return rows


def zb_h1_compute(p: int, m: int) -> list[list[Action]]:
    """ZB-H1: rank r runs 1F1B's min(p - 1 - r, m) warm-up forwards, then F, I pairs, each followed
    by the W of the microbatch r earlier once there is one; the cool-down alternates the remaining
    I passes with deferred W passes, then runs the W passes left."""
    rows = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        row = [Action(r, F, i) for i in range(warmup)]
        next_w = 0
        for k in range(m - warmup):
            row += [Action(r, F, warmup + k), Action(r, I, k)]
            if k - r >= 0:
                row.append(Action(r, W, k - r))
                next_w = k - r + 1
        for k in range(m - warmup, m):
            row.append(Action(r, I, k))
            if next_w <= k:
                row.append(Action(r, W, next_w))
                next_w += 1
        row += [Action(r, W, i) for i in range(next_w, m)]
        rows.append(row)
    return rows


def zb_h2_compute(p: int, m: int) -> list[list[Action]]:
    """ZB-H2 (Qi et al. 2024, sec. 2.2): up to 2p - 1 microbatches in flight on every rank, so the
    warm-up runs more forwards and the W passes fill the tail, and back-to-back iterations (no
    synchronization between them: the paper's optimizer post-validation) leave no bubble. Built by
    list scheduling at unit costs (``list_scheduled``): an I (the critical path) before an F (while
    fewer than 2p - 1 forwards await their W) before a W."""
    return list_scheduled(p, m, LOOP, 1, cap=2 * p - 1, priority=lambda kind, chunk: {I: 0, F: 1, W: 2}[kind])


def zb_v_compute(p: int, m: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2024, sec. 6): two stages per rank on the V-shaped placement (rank r holds
    stages r and 2p - 1 - r, so rank 0 holds the first and the last), backward split into I and W,
    at most 2p stage activations per rank (1F1B's p microbatches, a stage being half a rank's
    layers). Built by list scheduling at unit costs (``list_scheduled``) with the work that brings
    a microbatch nearest to done first: the forward of the second arm of the V (toward the loss),
    then the input gradients (the first arm's, nearer stage 0, before the second's), then the
    forward of a new microbatch on the first arm, and W passes last. For m >= 2p - 1 it meets the
    lower bound: a step takes 6m + p - 1 units (the last rank cannot start before p - 1 and has 6m of
    work), an idle p - 1 per rank, half ZB-H1's at the same memory (tests/test_reference_pipeline_schedules.py)."""
    order = {(F, 1): 0, (I, 0): 1, (I, 1): 2, (F, 0): 3}
    return list_scheduled(p, m, V_SHAPE, 2, cap=2 * p, priority=lambda kind, chunk: order.get((kind, chunk), 4))


def list_scheduled(p: int, m: int, placement: str, stages_per_rank: int, cap: int, priority) -> list[list[Action]]:
    """A split-backward schedule built by list scheduling at unit costs (F = I = W = 1, free
    messages), as the zero-bubble paper builds its heuristic schedules: whenever a rank is free it
    runs, among the actions it may start then (an F whose input is there while fewer than ``cap``
    forwards on the rank await their W; an I whose output gradient is there; the oldest waiting W),
    the one with the smallest ``priority(kind, chunk)`` (chunk: the stage's position among the
    rank's stages); the rank that can start earliest goes first, ties by rank. Microbatches run in
    order on every stage."""
    S = p * stages_per_rank
    stages = [rank_stages(r, p, S, placement) for r in range(p)]
    free, live = [0] * p, [0] * p
    end: dict[Action, int] = {}
    count = {kind: [0] * S for kind in (F, I)}
    waiting_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    rows: list[list[Action]] = [[] for _ in range(p)]

    def candidates(r: int):
        for chunk, s in enumerate(stages[r]):
            k = count[I][s]
            if k < count[F][s]:
                ready = end[Action(s, F, k)] if s == S - 1 else end.get(Action(s + 1, I, k))
                if ready is not None:
                    yield max(free[r], ready), priority(I, chunk), I, s
            k = count[F][s]
            if k < m and live[r] < cap:
                ready = 0 if s == 0 else end.get(Action(s - 1, F, k))
                if ready is not None:
                    yield max(free[r], ready), priority(F, chunk), F, s
        if waiting_w[r]:
            yield free[r], priority(W, stages[r].index(waiting_w[r][0][0])), W, waiting_w[r][0][0]

    for _ in range(3 * m * S):
        options = [(start, rank_first, r, kind, s) for r in range(p) for start, rank_first, kind, s in candidates(r)]
        if not options:
            raise ValueError(f"list scheduling is stuck (p={p}, m={m}, cap={cap}): no rank can start anything")
        start, _, r, kind, s = min(options)
        free[r] = start + 1
        if kind == W:
            s, k = waiting_w[r].pop(0)
            live[r] -= 1
        else:
            k = count[kind][s]
            count[kind][s] += 1
            live[r] += kind == F
            if kind == I:
                waiting_w[r].append((s, k))
        end[Action(s, kind, k)] = start + 1
        rows[r].append(Action(s, kind, k))
    return rows


def dualpipe_v_compute(p: int, m: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-AI's DualPipe, DeepSeek-V3 technical report 2024, folded onto the V by
    Sea AI Lab; torch's ScheduleDualPipeV), m >= 2p: rank r, holding stage a = r and stage
    b = 2p - 1 - r, runs eight phases: 2(p - r - 1) forwards of a; r + 1 pairs F(a) F(b); p - r - 1
    times I(b) W(b) F(b); m - 2p + r + 1 times the overlapped pairs F(a)&B(b), F(b)&B(a); p - r - 1
    times B(b), F(b)&B(a); r + 1 pairs B(b) B(a), split into I with the W deferred from the middle
    pair on (from B(b) on odd ranks, from B(a) on even ones); p - r - 1 times a deferred W then I(a);
    the deferred W passes left. An overlapped pair (DualPipe hides one microbatch's communication
    behind the other's compute) is written here as its two actions in order, as torch's runtime
    runs it on one stream. At unit costs it meets ZB-V's lower bound 6m + p - 1, holding 2p + 1
    stage activations (tests/test_reference_pipeline_schedules.py); its gain, the overlap of
    all-to-all with compute, is outside a sequential cost model."""
    rows = []
    for r in range(p):
        a, b = r, 2 * p - 1 - r
        count = {(s, kind): 0 for s in (a, b) for kind in (F, B)}
        deferred: list[Action] = []
        row: list[Action] = []

        def forward(s):
            row.append(Action(s, F, count[(s, F)]))
            count[(s, F)] += 1

        def backward(s, split=False):
            i = count[(s, B)]
            count[(s, B)] += 1
            row.append(Action(s, I if split else B, i))
            if split:
                deferred.append(Action(s, W, i))

        def weight():
            row.append(deferred.pop(0))

        for _ in range(2 * (p - r - 1)):
            forward(a)
        for _ in range(r + 1):
            forward(a), forward(b)
        for _ in range(p - r - 1):
            backward(b, split=True), weight(), forward(b)
        for _ in range(m - 2 * p + r + 1):
            forward(a), backward(b)  # overlapped: F(a) & B(b)
            forward(b), backward(a)  # overlapped: F(b) & B(a)
        for _ in range(p - r - 1):
            backward(b), forward(b), backward(a)
        split = False
        for k in range(r + 1):
            split = split or (k == (r + 1) // 2 and r % 2 == 1)
            backward(b, split)
            split = split or (k == (r + 1) // 2 and r % 2 == 0)
            backward(a, split)
        for _ in range(p - r - 1):
            weight(), backward(a, split=True)
        while deferred:
            weight()
        rows.append(row)
    return rows


def looped_bfs_compute(p: int, m: int, v: int) -> list[list[Action]]:
    """Looped BFS (Lamy-Poirier, "Breadth-First Pipeline Parallelism", 2023; torch's
    ScheduleLoopedBFS): the looped placement (rank r holds stages r, r + p, ...) run breadth first:
    every microbatch's forward on the rank's first stage, then on its next, ..., then the backwards
    stage by stage in reverse, each stage's microbatches last-in first-out. GPipe over v chunks per
    rank: for m >= p the same bubble as interleaved 1F1B, (p - 1) / (v m + p - 1), holding all v m
    chunk activations."""
    rows = []
    for r in range(p):
        mine = list(range(r, p * v, p))
        rows.append([Action(s, F, i) for s in mine for i in range(m)]
                    + [Action(s, B, i) for s in reversed(mine) for i in reversed(range(m))])
    return rows


def interleaved_warmup(p: int, m: int, v: int, rank: int) -> int:
    """Megatron's warm-up forwards of rank ``rank``: (v - 1) p + 2 (p - 1 - rank), at most v m."""
    return min((v - 1) * p + 2 * (p - 1 - rank), v * m)


def interleaved_compute(p: int, m: int, v: int) -> list[list[Action]]:
    if v == 1:
        return one_f_one_b_compute(p, m)
    rows = []
    for r in range(p):
        def action(k: int, kind: str) -> Action:
            chunk = (k % (p * v)) // p
            if kind == B:
                chunk = v - 1 - chunk
            return Action(chunk * p + r, kind, (k // (p * v)) * p + k % p)

        total, warmup = v * m, interleaved_warmup(p, m, v, r)
        row = [action(k, F) for k in range(warmup)]
        for k in range(total - warmup):
            row += [action(warmup + k, F), action(k, B)]
        row += [action(k, B) for k in range(total - warmup, total)]
        rows.append(row)
    return rows


def add_communication(compute: Schedule) -> Schedule:
    """Insert, on every rank, each receive right before the compute that needs it and each send
    right after the compute that produced it (transfers between stages on one rank stay local)."""
    last = compute.num_stages - 1
    rows = []
    for r, row in enumerate(compute.rows):
        out = []
        for a in row:
            if a.kind == F and a.stage > 0 and compute.rank_of(a.stage - 1) != r:
                out.append(Action(a.stage, RECV_F, a.microbatch))
            if a.kind in BACKWARD_INPUT and a.stage < last and compute.rank_of(a.stage + 1) != r:
                out.append(Action(a.stage, RECV_B, a.microbatch))
            out.append(a)
            if a.kind == F and a.stage < last and compute.rank_of(a.stage + 1) != r:
                out.append(Action(a.stage, SEND_F, a.microbatch))
            if a.kind in BACKWARD_INPUT and a.stage > 0 and compute.rank_of(a.stage - 1) != r:
                out.append(Action(a.stage, SEND_B, a.microbatch))
        rows.append(out)
    return compute.with_rows(rows)


def generate(kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """The reference schedule of ``kind`` (gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v,
    looped-bfs), with its communication, on the kind's placement (``placement_of``)."""
    check_arguments(kind, num_ranks, num_microbatches, stages_per_rank)
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    compute = {"gpipe": lambda: gpipe_compute(p, m), "1f1b": lambda: one_f_one_b_compute(p, m),
               "interleaved": lambda: interleaved_compute(p, m, v), "zb-h1": lambda: zb_h1_compute(p, m),
               "zb-h2": lambda: zb_h2_compute(p, m), "zb-v": lambda: zb_v_compute(p, m),
               "looped-bfs": lambda: looped_bfs_compute(p, m, v), "dualpipev": lambda: dualpipe_v_compute(p, m)}[kind]()
    return add_communication(Schedule(p, p * v, m, tuple(tuple(row) for row in compute), placement_of(kind)))


def placement_of(kind: str) -> str:
    """Where a kind puts its stages: the V shape for ZB-V and DualPipeV, the loop (s % p) for every other."""
    return V_SHAPE if kind in ON_THE_V else LOOP


def random_schedule(num_ranks: int, num_microbatches: int, stages_per_rank: int, seed: int,
                    split_backward: bool = False, placement: str = LOOP) -> Schedule:
    """A valid, deadlock-free schedule in no classic shape: compute actions are taken one at a time,
    each a random pick among those whose inputs are ready, then communication is inserted. Every
    rank's list follows one global order, so every receive's send comes earlier in it. With
    ``split_backward`` every backward is an I and a W, the W anywhere after its I."""
    rng = random.Random(seed)
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    last = p * v - 1
    done: set[Action] = set()
    rows: list[list[Action]] = [[] for _ in range(p)]
    kinds = (F, I, W) if split_backward else (F, B)
    pending = {Action(s, k, i) for s in range(last + 1) for k in kinds for i in range(m)}
    gradient = I if split_backward else B

    def ready(a: Action) -> bool:
        if a.kind == F:
            return a.stage == 0 or Action(a.stage - 1, F, a.microbatch) in done
        if a.kind == W:
            return Action(a.stage, I, a.microbatch) in done
        return Action(a.stage, F, a.microbatch) in done and (
            a.stage == last or Action(a.stage + 1, gradient, a.microbatch) in done)

    while pending:
        choice = rng.choice(sorted(a for a in pending if ready(a)))
        pending.discard(choice)
        done.add(choice)
        rows[stage_rank(choice.stage, p, placement)].append(choice)
    return add_communication(Schedule(p, p * v, m, tuple(tuple(row) for row in rows), placement))


# ---------------------------------------------------------------------------------------- theory
def theory_bubble_fraction(kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1,
                           t_f=1, t_i=1, t_w=1) -> Fraction:
    """Idle time over p * makespan when every stage(-chunk) costs the same and messages are free:
    (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1) interleaved (any t_f, t_b).
    ZB-H1, with a backward split into I (t_i) and W (t_w), t_w <= t_f, t_w <= t_i, m >= p (Qi et
    al. 2024, section 3.1): each rank idles (p - 1)(t_f + t_i - t_w) of a makespan
    m (t_f + t_i + t_w) + (p - 1)(t_f + t_i - t_w): (p - 1) / (3m + p - 1) when all three are equal.
    ZB-V (two stages per rank in a V, costs per stage, t_f = t_i = t_w, m >= 2p - 1): the lower
    bound, a makespan of 6m + p - 1 with p - 1 idle per rank, (p - 1) / (6m + p - 1), half ZB-H1's
    idle time at the same memory. Looped BFS (any t_f, t_b): a makespan of
    (v m + p - 1 + (v - 1) max(0, p - m)) (t_f + t_b): interleaved's bubble once m >= p; with fewer
    microbatches than ranks each further chunk waits p - m for the first microbatch to come round."""
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if kind == "dualpipev":  # the overlapped pairs run in sequence
        if not t_f == t_i == t_w:
            raise ValueError(f"DualPipeV's bubble here is derived for t_f = t_i = t_w; got {t_f}, {t_i}, {t_w}")
        return Fraction(p - 1, 6 * m + p - 1)
    if kind == "zb-v":  # per stage costs; a stage is half a rank's layers
        if m < 2 * p - 1 or not t_f == t_i == t_w:
            raise ValueError(f"ZB-V's bubble is derived for m >= 2p - 1 and t_f = t_i = t_w; got p={p}, m={m}, "
                             f"t_f={t_f}, t_i={t_i}, t_w={t_w}")
        return Fraction(p - 1, 6 * m + p - 1)
    if kind == "looped-bfs":
        busy = v * m
        return 1 - Fraction(busy, busy + p - 1 + (v - 1) * max(0, p - m))
    if kind == "zb-h2":  # one step alone, at the unit costs it is built for (see theory_steady_period)
        if m < p or not t_f == t_i == t_w:
            raise ValueError(f"ZB-H2's single-step bubble is derived for m >= p and t_f = t_i = t_w; got p={p}, m={m}, "
                             f"t_f={t_f}, t_i={t_i}, t_w={t_w}")
        return Fraction(p - 1, 3 * m + p - 1)
    if kind == "zb-h1":
        if m < p or t_w > t_f or t_w > t_i:
            raise ValueError(f"ZB-H1's bubble is derived for m >= p and t_w <= min(t_f, t_i); got p={p}, m={m}, "
                             f"t_f={t_f}, t_i={t_i}, t_w={t_w}")
        idle = (p - 1) * (t_f + t_i - t_w)
        return Fraction(idle) / Fraction(m * (t_f + t_i + t_w) + idle)
    return Fraction(p - 1, (v if kind == "interleaved" else 1) * m + p - 1)


def theory_steady_period(kind: str, num_ranks: int, num_microbatches: int) -> int:
    """The time one more step adds when steps run back to back with no synchronization between them
    (reference.pipeline_simulator.steady_period), at unit costs F = I = W = 1 and free messages;
    the busy time per rank and step is 3m. ZB-H1: 3m + p - 1 for m >= p (its bubble stays, one
    (p - 1) per step). ZB-H2: max(3m, 2m + 2p - 1), so no bubble at all once m >= 2p - 1 (Qi et al.
    2024, sec. 2.2: "zero bubble" under post-validation). Derived from the simulator and checked
    exactly by Hypothesis (tests/test_reference_pipeline_schedules.py) over p <= 6, m <= 20."""
    p, m = num_ranks, num_microbatches
    if kind == "zb-h1":
        if m < p:
            raise ValueError(f"ZB-H1's steady period is derived for m >= p; got p={p}, m={m}")
        return 3 * m + p - 1
    if kind == "zb-h2":
        return max(3 * m, 2 * m + 2 * p - 1)
    raise ValueError(f"no steady-state period derived for {kind!r} (known: zb-h1, zb-h2)")


def theory_peak_live(kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int, rank: int) -> int:
    """Most forwards (stage-chunk activations) rank ``rank`` holds before their backward (B, or W
    when split) ran: GPipe m; 1F1B min(m, p - r); interleaved (v > 1) min(v m, warm-up + 1); ZB-H1
    min(m, p), 1F1B's largest, on every rank (rank r's r deferred W passes add to its p - r); ZB-H2
    min(m, 2p - 1) on every rank (the paper's (2p - 1) M_B); ZB-V min(2m, 2p) stage activations, a
    stage being half a rank's layers (the paper's p M_B, 1F1B's); looped BFS all v m."""
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if kind == "zb-v":
        return min(2 * m, 2 * p)
    if kind == "dualpipev":
        return 2 * p + 1
    if kind == "looped-bfs":
        return v * m
    if kind == "gpipe":
        return m
    if kind == "zb-h2":
        return min(m, 2 * p - 1)
    if kind == "zb-h1":
        return min(m, p)
    if kind == "1f1b" or v == 1:
        return min(m, p - rank)
    return min(v * m, interleaved_warmup(p, m, v, rank) + 1)


# ------------------------------------------------------------------------------------------- grid
def render_grid(schedule: Schedule, mark: tuple[int, int] | set | None = None, compute_only: bool = False) -> str:
    """Ranks as rows, steps (positions in each rank's list) as columns; the cells in ``mark``
    ((rank, step) pairs) are shown in [brackets]."""
    marks = set() if mark is None else ({mark} if isinstance(mark, tuple) else set(mark))
    rows = schedule.compute_only().rows if compute_only else schedule.rows
    cells = [[str(a) for a in row] for row in rows]
    width = max([len(c) for row in cells for c in row] + [3]) + 2
    steps = max((len(row) for row in cells), default=0)
    label = len(f"rank {len(cells) - 1}")
    lines = [f"{'step':<{label}} |" + "".join(f"{t:^{width}}" for t in range(steps))]
    for r, row in enumerate(cells):
        shown = [f"[{c}]" if (r, t) in marks else f" {c} " for t, c in enumerate(row)]
        lines.append(f"{f'rank {r}':<{label}} |" + "".join(f"{c:^{width}}" for c in shown).rstrip())
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- validator
RULES = {
    "shape": "the schedule has one list per rank and S = p * v stages (v = 2 for the V shape)",
    "placement": "stage s runs on its rank (s % p; in the V shape s for s < p, else 2p - 1 - s), 0 <= stage < S and "
                 "0 <= microbatch < m",
    "communication": "sends and receives cross a stage boundary between different ranks",
    "exactly once": "every forward and backward runs exactly once per stage and microbatch (a backward as one B, or as "
                    "an I and a W), every send or receive at most once",
    "backward after forward": "on each stage a microbatch's backward (B, or I) follows its forward",
    "weight after input": "a split backward's W comes after its I (the weights' gradient needs the output's gradient)",
    "forward dependency": "F of stage s > 0 needs F of stage s - 1: its receive (or the local forward) comes earlier on its rank",
    "backward dependency": "B or I of stage s < S - 1 needs the input gradient of stage s + 1 (its B or I): its receive "
                           "(or the local backward) comes earlier on its rank",
    "send after compute": "a send comes after the compute that produced what it sends",
    "matching send and receive": "every send has its receive on the peer's rank and every receive its send",
}


@dataclass(frozen=True)
class Problem:
    rule: str
    rank: int | None
    step: int | None
    action: Action | None
    why: str

    def where(self) -> str:
        step = "" if self.step is None else f", step {self.step}"
        action = "" if self.action is None else f": {self.action}"
        return f"rank {self.rank}{step}{action}" if self.rank is not None else "schedule"


def problems(schedule: Schedule) -> list[Problem]:
    """Every broken rule, in rule order, then by rank and step."""
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    found: list[Problem] = []
    if p < 1 or m < 1 or S < p or S % p or len(schedule.rows) != p:
        return [Problem("shape", None, None, None,
                        f"{len(schedule.rows)} rows for p={p} ranks, S={S} stages, m={m} microbatches "
                        f"({RULES['shape']}, m >= 1)")]
    if schedule.placement not in PLACEMENTS or (schedule.placement == V_SHAPE and S != 2 * p):
        return [Problem("shape", None, None, None,
                        f"placement {schedule.placement!r} with p={p} ranks and S={S} stages: the placements are "
                        f"{', '.join(PLACEMENTS)}, and the V shape holds two stages per rank")]
    position: dict[Action, tuple[int, int]] = {}
    for r, row in enumerate(schedule.rows):
        for t, a in enumerate(row):
            if not (0 <= a.stage < S and 0 <= a.microbatch < m):
                found.append(Problem("placement", r, t, a, f"stages are 0..{S - 1} and microbatches 0..{m - 1}"))
                continue
            if schedule.rank_of(a.stage) != r:
                found.append(Problem("placement", r, t, a, f"stage {a.stage} lives on rank {schedule.rank_of(a.stage)}, "
                                                           f"not rank {r}"))
                continue
            if not a.is_compute:
                peer = a.peer_stage
                if not 0 <= peer < S:
                    found.append(Problem("communication", r, t, a, f"stage {a.stage} has no peer stage {peer} "
                                                                   f"(stages are 0..{S - 1})"))
                    continue
                if schedule.rank_of(peer) == r:
                    found.append(Problem("communication", r, t, a, f"stages {a.stage} and {peer} both live on rank {r}: "
                                                                   f"the transfer is local, with no send or receive"))
                    continue
            if a in position:
                first = position[a]
                found.append(Problem("exactly once", r, t, a, f"{a} already ran at step {first[1]}"))
                continue
            position[a] = (r, t)

    def at(a: Action):
        return position.get(a, (None, None))[1]

    def input_gradient(stage: int, i: int) -> Action:
        """The action that makes stage ``stage``'s input gradient of microbatch i: its I if split, else its B."""
        return Action(stage, I, i) if Action(stage, I, i) in position else Action(stage, B, i)

    for s in range(S):
        r = schedule.rank_of(s)
        for i in range(m):
            if Action(s, F, i) not in position:
                found.append(Problem("exactly once", r, None, Action(s, F, i),
                                     f"the forward of microbatch {i} on stage {s} never runs (rank {r} has no {s}F{i})"))
            whole, half_i, half_w = (Action(s, k, i) in position for k in (B, I, W))
            if whole and (half_i or half_w):
                split = Action(s, I if half_i else W, i)
                found.append(Problem("exactly once", r, at(split), split,
                                     f"the backward of microbatch {i} on stage {s} runs whole ({s}B{i}, step "
                                     f"{at(Action(s, B, i))}) and split too"))
            elif not (whole or half_i or half_w):
                found.append(Problem("exactly once", r, None, Action(s, B, i),
                                     f"the backward of microbatch {i} on stage {s} never runs (rank {r} has no {s}B{i}, "
                                     f"nor {s}I{i} and {s}W{i})"))
            elif not whole and not half_w:
                found.append(Problem("exactly once", r, None, Action(s, W, i),
                                     f"the weight gradient of microbatch {i} on stage {s} is never computed: rank {r} "
                                     f"has {s}I{i} but no {s}W{i}"))
            elif not whole and not half_i:
                found.append(Problem("exactly once", r, at(Action(s, W, i)), Action(s, W, i),
                                     f"{s}W{i} has no {s}I{i}: the input gradient of microbatch {i} on stage {s} is "
                                     f"never computed"))
            grad = input_gradient(s, i)
            f, b = at(Action(s, F, i)), at(grad)
            if f is not None and b is not None and b < f:
                found.append(Problem("backward after forward", r, b, grad,
                                     f"the backward of microbatch {i} on stage {s} comes before its forward (step {f})"))
            w = at(Action(s, W, i))
            if w is not None and half_i and w < at(Action(s, I, i)):
                found.append(Problem("weight after input", r, w, Action(s, W, i),
                                     f"{s}W{i} comes before {s}I{i} (step {at(Action(s, I, i))})"))
            if f is not None and s > 0:
                found += _needs(schedule, position, r, f, Action(s, F, i), Action(s - 1, F, i), Action(s, RECV_F, i),
                                "forward dependency")
            if b is not None and s < S - 1:
                found += _needs(schedule, position, r, b, grad, input_gradient(s + 1, i), Action(s, RECV_B, i),
                                "backward dependency")
    for a, (r, t) in sorted(position.items(), key=lambda item: item[1]):
        if a.is_compute:
            continue
        if a.kind in (SEND_F, SEND_B):
            source = Action(a.stage, F, a.microbatch) if a.kind == SEND_F else input_gradient(a.stage, a.microbatch)
            if at(source) is not None and at(source) > t:
                found.append(Problem("send after compute", r, t, a,
                                     f"it sends the result of {source}, which runs later (step {at(source)})"))
        match = a.matching()
        if match not in position:
            owner = schedule.rank_of(match.stage)
            role = "its receive" if a.kind in (SEND_F, SEND_B) else "its send"
            found.append(Problem("matching send and receive", r, t, a,
                                 f"{role} {match} is not in rank {owner}'s list: "
                                 + ("the message is never received" if a.kind in (SEND_F, SEND_B)
                                    else "it would wait forever")))
    order = list(RULES)
    return sorted(found, key=lambda pr: (order.index(pr.rule), pr.rank if pr.rank is not None else -1,
                                         pr.step if pr.step is not None else -1))


def _needs(schedule, position, r, step, action, local_input, receive, rule) -> list[Problem]:
    """``action`` at ``step`` on rank ``r`` needs ``local_input`` earlier on the same rank when that
    stage is local, else ``receive`` earlier."""
    what = "activations" if action.kind == F else "input gradient"
    if schedule.rank_of(local_input.stage) == r:
        before = position.get(local_input)
        if before is not None and before[1] > step:
            return [Problem(rule, r, step, action, f"it needs {local_input} on the same rank, which runs later "
                                                   f"(step {before[1]})")]
        return []
    got = position.get(receive)
    if got is None:
        return [Problem(rule, r, step, action, f"it needs the {what} of stage {local_input.stage} from rank "
                                               f"{schedule.rank_of(local_input.stage)}, but rank {r} has no {receive}")]
    if got[1] > step:
        return [Problem(rule, r, step, action, f"it needs {receive} first, which comes later (step {got[1]})")]
    return []


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError for the first broken rule (with the grid and the bad action marked)."""
    found = problems(schedule)
    if not found:
        return
    first = found[0]
    lines = [f"invalid schedule (p={schedule.num_ranks}, S={schedule.num_stages}, m={schedule.num_microbatches}): "
             f"{first.where()} breaks rule '{first.rule}': {first.why}",
             f"  rule '{first.rule}': {RULES[first.rule]}"]
    if len(found) > 1:
        lines.append(f"  {len(found) - 1} more problem(s), first ones:")
        lines += [f"    - {pr.where()}: '{pr.rule}': {pr.why}" for pr in found[1:6]]
    if first.rule != "shape":
        mark = (first.rank, first.step) if first.step is not None else None
        lines += ["", render_grid(schedule, mark)]
    raise ScheduleError("\n".join(lines), rank=first.rank, step=first.step, action=first.action, rule=first.rule)
