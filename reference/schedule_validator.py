"""The schedule validator: every rule a runnable schedule keeps (RULES), each broken one reported as
a Problem naming the rank, the step and the action, on the step grid."""

from __future__ import annotations

from dataclasses import dataclass

from parallelism_conformance.reference.schedule_format import (
    PLACEMENTS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    V_SHAPE,
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
    render_grid,
)

RULES = {
    "shape": "the schedule has one list per rank and S = p * v stages (v = 2 for the V shape)",
    "placement": "stage s runs on its rank (s % p; in the V shape s for s < p, else 2p - 1 - s), 0 <= stage < S and 0 <= microbatch < m",
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
        return [
            Problem(
                "shape",
                None,
                None,
                None,
                f"{len(schedule.rows)} rows for p={p} ranks, S={S} stages, m={m} microbatches ({RULES['shape']}, m >= 1)",
            )
        ]
    if schedule.placement not in PLACEMENTS or (schedule.placement == V_SHAPE and S != 2 * p):
        return [
            Problem(
                "shape",
                None,
                None,
                None,
                f"placement {schedule.placement!r} with p={p} ranks and S={S} stages: the placements are "
                f"{', '.join(PLACEMENTS)}, and the V shape holds two stages per rank",
            )
        ]
    position: dict[Action, tuple[int, int]] = {}
    for r, row in enumerate(schedule.rows):
        for t, a in enumerate(row):
            if not (0 <= a.stage < S and 0 <= a.microbatch < m):
                found.append(Problem("placement", r, t, a, f"stages are 0..{S - 1} and microbatches 0..{m - 1}"))
                continue
            if schedule.rank_of(a.stage) != r:
                found.append(Problem("placement", r, t, a, f"stage {a.stage} lives on rank {schedule.rank_of(a.stage)}, not rank {r}"))
                continue
            if not a.is_compute:
                peer = a.peer_stage
                if not 0 <= peer < S:
                    found.append(Problem("communication", r, t, a, f"stage {a.stage} has no peer stage {peer} (stages are 0..{S - 1})"))
                    continue
                if schedule.rank_of(peer) == r:
                    found.append(
                        Problem(
                            "communication",
                            r,
                            t,
                            a,
                            f"stages {a.stage} and {peer} both live on rank {r}: the transfer is local, with no send or receive",
                        )
                    )
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
                found.append(
                    Problem(
                        "exactly once",
                        r,
                        None,
                        Action(s, F, i),
                        f"the forward of microbatch {i} on stage {s} never runs (rank {r} has no {s}F{i})",
                    )
                )
            whole, half_i, half_w = (Action(s, k, i) in position for k in (B, I, W))
            if whole and (half_i or half_w):
                split = Action(s, I if half_i else W, i)
                found.append(
                    Problem(
                        "exactly once",
                        r,
                        at(split),
                        split,
                        f"the backward of microbatch {i} on stage {s} runs whole ({s}B{i}, step {at(Action(s, B, i))}) and split too",
                    )
                )
            elif not (whole or half_i or half_w):
                found.append(
                    Problem(
                        "exactly once",
                        r,
                        None,
                        Action(s, B, i),
                        f"the backward of microbatch {i} on stage {s} never runs (rank {r} has no {s}B{i}, nor {s}I{i} and {s}W{i})",
                    )
                )
            elif not whole and not half_w:
                found.append(
                    Problem(
                        "exactly once",
                        r,
                        None,
                        Action(s, W, i),
                        f"the weight gradient of microbatch {i} on stage {s} is never computed: rank {r} has {s}I{i} but no {s}W{i}",
                    )
                )
            elif not whole and not half_i:
                found.append(
                    Problem(
                        "exactly once",
                        r,
                        at(Action(s, W, i)),
                        Action(s, W, i),
                        f"{s}W{i} has no {s}I{i}: the input gradient of microbatch {i} on stage {s} is never computed",
                    )
                )
            grad = input_gradient(s, i)
            f, b = at(Action(s, F, i)), at(grad)
            if f is not None and b is not None and b < f:
                found.append(
                    Problem(
                        "backward after forward", r, b, grad, f"the backward of microbatch {i} on stage {s} comes before its forward (step {f})"
                    )
                )
            w = at(Action(s, W, i))
            if w is not None and half_i and w < at(Action(s, I, i)):
                found.append(Problem("weight after input", r, w, Action(s, W, i), f"{s}W{i} comes before {s}I{i} (step {at(Action(s, I, i))})"))
            if f is not None and s > 0:
                found += _needs(schedule, position, r, f, Action(s, F, i), Action(s - 1, F, i), Action(s, RECV_F, i), "forward dependency")
            if b is not None and s < S - 1:
                found += _needs(schedule, position, r, b, grad, input_gradient(s + 1, i), Action(s, RECV_B, i), "backward dependency")
    for a, (r, t) in sorted(position.items(), key=lambda item: item[1]):
        if a.is_compute:
            continue
        if a.kind in (SEND_F, SEND_B):
            source = Action(a.stage, F, a.microbatch) if a.kind == SEND_F else input_gradient(a.stage, a.microbatch)
            if at(source) is not None and at(source) > t:
                found.append(Problem("send after compute", r, t, a, f"it sends the result of {source}, which runs later (step {at(source)})"))
        match = a.matching()
        if match not in position:
            owner = schedule.rank_of(match.stage)
            role = "its receive" if a.kind in (SEND_F, SEND_B) else "its send"
            found.append(
                Problem(
                    "matching send and receive",
                    r,
                    t,
                    a,
                    f"{role} {match} is not in rank {owner}'s list: "
                    + ("the message is never received" if a.kind in (SEND_F, SEND_B) else "it would wait forever"),
                )
            )
    order = list(RULES)
    return sorted(found, key=lambda pr: (order.index(pr.rule), pr.rank if pr.rank is not None else -1, pr.step if pr.step is not None else -1))


def _needs(schedule, position, r, step, action, local_input, receive, rule) -> list[Problem]:
    """``action`` at ``step`` on rank ``r`` needs ``local_input`` earlier on the same rank when that
    stage is local, else ``receive`` earlier."""
    what = "activations" if action.kind == F else "input gradient"
    if schedule.rank_of(local_input.stage) == r:
        before = position.get(local_input)
        if before is not None and before[1] > step:
            return [Problem(rule, r, step, action, f"it needs {local_input} on the same rank, which runs later (step {before[1]})")]
        return []
    got = position.get(receive)
    if got is None:
        return [
            Problem(
                rule,
                r,
                step,
                action,
                f"it needs the {what} of stage {local_input.stage} from rank "
                f"{schedule.rank_of(local_input.stage)}, but rank {r} has no {receive}",
            )
        ]
    if got[1] > step:
        return [Problem(rule, r, step, action, f"it needs {receive} first, which comes later (step {got[1]})")]
    return []


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError for the first broken rule (with the grid and the bad action marked)."""
    found = problems(schedule)
    if not found:
        return
    first = found[0]
    lines = [
        f"invalid schedule (p={schedule.num_ranks}, S={schedule.num_stages}, m={schedule.num_microbatches}): "
        f"{first.where()} breaks rule '{first.rule}': {first.why}",
        f"  rule '{first.rule}': {RULES[first.rule]}",
    ]
    if len(found) > 1:
        lines.append(f"  {len(found) - 1} more problem(s), first ones:")
        lines += [f"    - {pr.where()}: '{pr.rule}': {pr.why}" for pr in found[1:6]]
    if first.rule != "shape":
        mark = (first.rank, first.step) if first.step is not None else None
        lines += ["", render_grid(schedule, mark)]
    raise ScheduleError("\n".join(lines), rank=first.rank, step=first.step, action=first.action, rule=first.rule)
