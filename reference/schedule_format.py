"""The format of a pipeline schedule (reference/pipeline_schedules.py says what it means): the
actions, stage placement, the Schedule of per-rank rows, its compact strings, and its step grid."""

from __future__ import annotations

import re
from dataclasses import dataclass
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
            raise ValueError(
                f"{text!r} is not an action in compact form <stage><kind><microbatch> with kind one of "
                f"{', '.join((*COMPUTE, *COMMUNICATION))} (e.g. '0F3', '2SEND_B1')"
            )
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
        return Schedule(self.num_ranks, self.num_stages, self.num_microbatches, tuple(tuple(r) for r in rows), self.placement)

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

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None, action: Action | None = None, rule: str = ""):
        super().__init__(message)
        self.rank, self.step, self.action, self.rule = rank, step, action, rule


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
