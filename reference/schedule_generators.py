"""The schedule generators (reference/pipeline_schedules.py describes each with its source): compute
orders per rank for GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, ZB-V, DualPipeV and looped BFS,
with communication inserted by ``add_communication``, and random valid schedules."""

from __future__ import annotations

import random

from parallelism_conformance.reference.schedule_format import (
    ALL_KINDS,
    BACKWARD_INPUT,
    LOOP,
    ON_THE_V,
    RECV_B,
    RECV_F,
    REFERENCE_ONLY_KINDS,
    SEND_B,
    SEND_F,
    V_SHAPE,
    Action,
    B,
    F,
    I,
    Schedule,
    W,
    rank_stages,
    stage_rank,
)


def check_arguments(kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> None:
    """The ValueError a generator raises for arguments it cannot schedule."""
    if kind not in (*ALL_KINDS, *REFERENCE_ONLY_KINDS):
        raise ValueError(f"unknown schedule kind {kind!r} (known: {', '.join((*ALL_KINDS, *REFERENCE_ONLY_KINDS))})")
    if num_ranks < 1 or num_microbatches < 1 or stages_per_rank < 1:
        raise ValueError(
            f"num_ranks, num_microbatches and stages_per_rank must be at least 1, got {num_ranks}, {num_microbatches}, {stages_per_rank}"
        )
    if kind in ON_THE_V and stages_per_rank != 2:
        raise ValueError(f"{kind} places two stages per rank in a V; stages_per_rank={stages_per_rank} must be 2")
    if kind == "dualpipev" and num_microbatches < 2 * num_ranks:
        raise ValueError(f"DualPipeV needs at least as many microbatches as stages: m={num_microbatches} < 2p={2 * num_ranks}")
    if kind not in ("interleaved", "looped-bfs", *ON_THE_V) and stages_per_rank != 1:
        raise ValueError(f"{kind} places one stage per rank; stages_per_rank={stages_per_rank} needs 'interleaved'")
    if kind == "interleaved" and num_microbatches % num_ranks:
        raise ValueError(
            f"interleaved 1F1B needs the number of microbatches to be a multiple of the number of "
            f"ranks: m={num_microbatches} is not a multiple of p={num_ranks}"
        )


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
        rows.append([Action(s, F, i) for s in mine for i in range(m)] + [Action(s, B, i) for s in reversed(mine) for i in reversed(range(m))])
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
    compute = {
        "gpipe": lambda: gpipe_compute(p, m),
        "1f1b": lambda: one_f_one_b_compute(p, m),
        "interleaved": lambda: interleaved_compute(p, m, v),
        "zb-h1": lambda: zb_h1_compute(p, m),
        "zb-h2": lambda: zb_h2_compute(p, m),
        "zb-v": lambda: zb_v_compute(p, m),
        "looped-bfs": lambda: looped_bfs_compute(p, m, v),
        "dualpipev": lambda: dualpipe_v_compute(p, m),
    }[kind]()
    return add_communication(Schedule(p, p * v, m, tuple(tuple(row) for row in compute), placement_of(kind)))


def placement_of(kind: str) -> str:
    """Where a kind puts its stages: the V shape for ZB-V and DualPipeV, the loop (s % p) for every other."""
    return V_SHAPE if kind in ON_THE_V else LOOP


def random_schedule(
    num_ranks: int, num_microbatches: int, stages_per_rank: int, seed: int, split_backward: bool = False, placement: str = LOOP
) -> Schedule:
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
        return Action(a.stage, F, a.microbatch) in done and (a.stage == last or Action(a.stage + 1, gradient, a.microbatch) in done)

    while pending:
        choice = rng.choice(sorted(a for a in pending if ready(a)))
        pending.discard(choice)
        done.add(choice)
        rows[stage_rank(choice.stage, p, placement)].append(choice)
    return add_communication(Schedule(p, p * v, m, tuple(tuple(row) for row in rows), placement))
