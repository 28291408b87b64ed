"""Running a schedule on paper: each rank's timeline, the makespan, the bubble, activation memory,
and deadlocks.

Semantics (those of the bundled runtime, impls/pipeline_parallel.py): every rank executes its list
in order, starting at time 0. F and B of stage s take ``forward(s)`` and ``backward(s)``; a split
backward's W takes ``weight(s)`` (default half the backward) and its I the rest; a send
never blocks (isend): it occupies its rank for ``send`` (default 0) and its message is available
``latency`` (default 0) after that; a receive blocks its rank until the matching message is
available, then occupies it for ``receive`` more (default 0: the receiving side's own cost, paid
even when the message was sent long before). A rank is busy only in F, B, I and W; everything else,
communication included, is idle time:

    bubble fraction = sum over ranks of (makespan - busy time) / (p * makespan).

With integer or Fraction costs every time is exact, and the bubble is a Fraction. The live
activations of a rank are the forwards whose backward (B, or W when split: the weights' gradient
needs the stored input) has not run yet (counted per stage-chunk);
their peak depends only on the order of the rank's list.

A receive whose send is behind a receive of the sender's that can never complete is a deadlock:
simulate raises DeadlockError naming the stuck ranks, their next actions and the wait-for cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from parallelism_conformance.reference.pipeline_schedules import (
    COMPUTE,
    RECV_B,
    RECV_F,
    RELEASES,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    ScheduleError,
    W,
    render_grid,
    validate,
)


@dataclass(frozen=True)
class Costs:
    """Time of a forward and a backward (a number, or {stage: number}); of a split backward's W
    (``weight``, default half the backward) and I (``input``, default the backward less W: set it
    when whole and split backwards cost differently, as in DualPipeV on a runtime that walks the
    graph twice); of a message in flight (``latency``); and the time a send and a receive occupy
    their rank (``send``, ``receive``)."""

    forward: object = 1
    backward: object = 2
    latency: object = 0
    send: object = 0
    receive: object = 0
    weight: object = None
    input: object = None

    def of(self, action: Action):
        def at(cost):
            return cost[action.stage] if isinstance(cost, dict) else cost

        if action.kind == F:
            return at(self.forward)
        backward = at(self.backward)
        if action.kind == B:
            return backward
        weight = at(self.weight) if self.weight is not None else (Fraction(backward) / 2 if _exact(backward) else backward / 2)
        if action.kind == W:
            return weight
        return at(self.input) if self.input is not None else backward - weight


@dataclass(frozen=True)
class Interval:
    start: object
    end: object
    action: Action

    def __iter__(self):  # (start, end, action)
        return iter((self.start, self.end, self.action))


@dataclass
class Simulation:
    timelines: list[list[Interval]]  # per rank, every action; a receive from reaching it to having the message
    makespan: object
    busy: list  # per rank, time in F and B
    idle: list  # per rank, makespan - busy
    bubble_fraction: object  # Fraction when every cost is exact
    peak_live: list[int]  # per rank, most forwards whose backward has not run
    schedule: Schedule = field(repr=False)
    costs: Costs = field(default_factory=Costs, repr=False)

    def render(self, width: int = 100) -> str:
        """A text Gantt chart: one row per rank, '.' idle, 'F', 'b' (B or I), 'w' (W) busy, the
        microbatch's last digit at the start of each."""
        if not self.makespan:
            return ""
        scale = width / self.makespan
        lines = []
        for r, timeline in enumerate(self.timelines):
            row = ["."] * width
            for start, end, action in timeline:
                if action.kind not in COMPUTE:
                    continue
                a, b = int(start * scale), max(int(start * scale) + 1, int(end * scale))
                for x in range(a, min(b, width)):
                    row[x] = {F: "F", W: "w"}.get(action.kind, "b")
                row[a] = str(action.microbatch % 10)
            lines.append(f"rank {r} |{''.join(row)}|")
        return "\n".join(lines)


class DeadlockError(ScheduleError):
    """``stuck``: {rank: (step, action)} of every rank that cannot go on; ``cycle``: ranks that
    wait for each other, in wait-for order."""

    def __init__(self, message: str, *, stuck: dict, cycle: list[int]):
        super().__init__(message, rule="no deadlock")
        self.stuck, self.cycle = stuck, cycle


def _exact(*values) -> bool:
    return all(isinstance(v, (int, Fraction)) for v in values)


def _ratio(a, b):
    return Fraction(a) / Fraction(b) if _exact(a, b) else a / b


def peak_live(row) -> int:
    live = peak = 0
    for a in row:
        if a.kind == F:
            live += 1
            peak = max(peak, live)
        elif a.kind in RELEASES:
            live -= 1
    return peak


def simulate(schedule: Schedule, costs: Costs = Costs(), *, check: bool = True) -> Simulation:
    """Run ``schedule`` (validated first unless ``check`` is False) under ``costs``."""
    if check:
        validate(schedule)
    p = schedule.num_ranks
    rows = schedule.rows
    next_step = [0] * p
    clock = [0] * p
    busy = [0] * p
    available: dict[Action, object] = {}  # a posted send -> when its message can be received
    timelines: list[list[Interval]] = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while next_step[r] < len(rows[r]):
                a = rows[r][next_step[r]]
                now = clock[r]
                if a.kind in COMPUTE:
                    cost = costs.of(a)
                    clock[r] = now + cost
                    busy[r] = busy[r] + cost
                elif a.kind in (SEND_F, SEND_B):
                    clock[r] = now + costs.send
                    available[a] = clock[r] + costs.latency
                else:
                    send = a.matching()
                    if send not in available:
                        break
                    clock[r] = max(now, available[send]) + costs.receive
                timelines[r].append(Interval(now, clock[r], a))
                next_step[r] += 1
                progress = True
    stuck = {r: (next_step[r], rows[r][next_step[r]]) for r in range(p) if next_step[r] < len(rows[r])}
    if stuck:
        raise _deadlock(schedule, stuck)
    makespan = max(clock)
    idle = [makespan - b for b in busy]
    bubble = _ratio(sum(idle), p * makespan) if makespan else 0
    return Simulation(timelines, makespan, busy, idle, bubble, [peak_live(row) for row in rows], schedule, costs)


def back_to_back(schedule: Schedule, iterations: int) -> Schedule:
    """``iterations`` steps of ``schedule`` run one after the other with no synchronization between
    them (each rank starts its next step when it has finished its own part of this one, as with
    the zero-bubble paper's optimizer post-validation): every rank's list repeated, step k's
    microbatches renumbered k m .. k m + m - 1."""
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, got {iterations}")
    m = schedule.num_microbatches
    rows = tuple(tuple(Action(a.stage, a.kind, a.microbatch + k * m) for k in range(iterations) for a in row) for row in schedule.rows)
    return Schedule(schedule.num_ranks, schedule.num_stages, m * iterations, rows, schedule.placement)


def steady_period(schedule: Schedule, costs: Costs = Costs()) -> object:
    """The time one more step adds when steps run back to back (``back_to_back``): the makespan of
    three steps minus that of two. Busy time per step is a lower bound; a schedule whose period
    equals it has no bubble in steady state."""
    return simulate(back_to_back(schedule, 3), costs).makespan - simulate(back_to_back(schedule, 2), costs).makespan


def _deadlock(schedule: Schedule, stuck: dict) -> DeadlockError:
    waits_for = {}
    for r, (_, a) in stuck.items():
        waits_for[r] = schedule.rank_of(a.matching().stage) if a.kind in (RECV_F, RECV_B) else None
    cycle: list[int] = []
    start = next(iter(stuck))
    seen: list[int] = []
    r = start
    while r is not None and r in stuck and r not in seen:
        seen.append(r)
        r = waits_for[r]
    if r is not None and r in seen:
        cycle = seen[seen.index(r) :]
    lines = [
        f"deadlock: {len(stuck)} rank(s) can never go on (p={schedule.num_ranks}, S={schedule.num_stages}, m={schedule.num_microbatches}):"
    ]
    for r, (step, a) in stuck.items():
        send = a.matching()
        owner = schedule.rank_of(send.stage)
        where = next((t for t, x in enumerate(schedule.rows[owner]) if x == send), None)
        blocked = stuck.get(owner)
        lines.append(
            f"  rank {r} waits at step {step} in {a} for {send}, step {where} of rank {owner}"
            + (f", which itself is stuck at step {blocked[0]} ({blocked[1]})" if blocked else "")
        )
    if cycle:
        lines.append("  wait-for cycle: " + " -> ".join(f"rank {r}" for r in [*cycle, cycle[0]]))
    lines += ["", render_grid(schedule, {(r, step) for r, (step, _) in stuck.items()})]
    return DeadlockError("\n".join(lines), stuck=stuck, cycle=cycle)
