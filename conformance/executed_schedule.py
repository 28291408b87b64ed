"""The schedule asked for is the schedule run (issue 14): hooks on the stage modules the harness
built record each rank's order of stage forwards ("F<s>") and parameter-gradient accumulations
("B<s>"), one list per rank with a "CALL" marker before each pipeline_step call
(harness/rank/programs/pipeline_stages.py, ``watch``). Judged here against the schedule handed
over (its compute order, exactly) or, for the classic kinds, the most microbatch activations the
kind holds at once (reference/pipeline_schedules.py, ``theory_peak_live``). Used by the pipeline
tests and the pipeline compositions."""

from __future__ import annotations

import parallelism_conformance.reference.pipeline_schedules as sched
from parallelism_conformance.conformance.verdict import Judge


def expected_order(example) -> sched.Schedule | None:
    """The schedule the ranks were asked to run, exactly: one handed over as rows, or ZB-H1 (whose
    point is its order: its W passes deferred into the bubbles); None for the classic kinds, whose
    exact interleaving an implementation may vary (only their memory bound is held)."""
    p, m, v = example.num_ranks, example.num_microbatches, example.stages_per_rank
    if example.kind in sched.ZERO_BUBBLE_KINDS:
        return sched.generate(example.kind, p, m, v).compute_only()
    return example.rows().compute_only() if example.as_rows else None


def observed(action: sched.Action) -> str | None:
    """What the harness's hooks see of an action: a stage's forward ("F<s>"), and the moment its
    parameters' gradients are accumulated ("B<s>": the end of a B, or a W); an I touches no
    parameter gradient and is not seen."""
    if action.kind == sched.F:
        return f"F{action.stage}"
    return f"B{action.stage}" if action.kind in sched.RELEASES else None


def without_warm_up_forwards(executed: list[str], m: int) -> list[str]:
    """A stage runs m forwards in a step; forwards beyond m that come first are a runtime's own
    warm-up (torch.distributed.pipelining runs one forward per stage to infer shapes before the
    first microbatch) and hold no activation of the schedule: they are dropped."""
    extra = {}
    for action in executed:
        if action.startswith("F"):
            extra[action] = extra.get(action, 0) + 1
    extra = {action: count - m for action, count in extra.items() if count > m}
    kept = []
    for action in executed:
        if extra.get(action, 0) > 0:
            extra[action] -= 1
            continue
        kept.append(action)
    return kept


def judge_executed_schedule(judge: Judge, example, outputs: dict, order: sched.Schedule | None = None) -> None:
    """The schedule asked for is the schedule run (issue 14): each rank's order of stage forwards
    and backwards, seen by hooks on the stage modules the harness built, must be the given
    schedule's compute order (random schedules), and no rank may hold more microbatch activations
    at once than the kind allows (GPipe m, 1F1B min(m, p - r), interleaved min(vm, warm-up + 1)):
    a runtime asked for 1F1B that runs GPipe gets every number right and holds m, not p."""
    order = order or expected_order(example)
    for r in range(example.num_ranks):
        executed = outputs[r].get("executed")
        if not isinstance(executed, list):
            judge.fail(f"rank {r}: the rank program recorded no order of forwards and backwards")
        for call, segment in enumerate(calls_of(executed)):
            judge_one_call(judge, example, r, segment, order, f" (pipeline_step call {call + 1})" if call else "")


def calls_of(executed: list[str]) -> list[list[str]]:
    """The recorded order cut at each CALL marker (harness/rank/programs/pipeline_parallel.py): one
    list per pipeline_step call, or one list when nothing marks the calls."""
    calls, current = [], []
    for action in executed:
        if action == "CALL":
            if current:
                calls.append(current)
            current = []
        else:
            current.append(action)
    return [*calls, current] if current or not calls else calls


def peak_live(executed: list[str]) -> int:
    """The most microbatch activations a rank held at once: forwards not yet answered by a backward."""
    live = peak = 0
    for action in executed:
        live += 1 if action.startswith("F") else -1
        peak = max(peak, live)
    return peak


def judge_one_call(judge: Judge, example, r: int, executed: list[str], order, which: str) -> None:
    """One pipeline_step call's recorded order on rank r: the schedule's compute order, or within
    the kind's memory bound."""
    p, m, v = example.num_ranks, example.num_microbatches, example.stages_per_rank
    executed = without_warm_up_forwards(executed, m)
    if order is not None:
        want = [seen for seen in map(observed, order.rows[r]) if seen is not None]
        if executed != want:
            first = next((i for i, (a, b) in enumerate(zip(executed, want)) if a != b), min(len(executed), len(want)))
            judge.fail(
                f"rank {r} did not run the schedule it was given{which}: at its compute step {first + 1} it "
                f"ran {executed[first] if first < len(executed) else 'nothing'} where the schedule says "
                f"{want[first] if first < len(want) else 'nothing more'}; ran {' '.join(executed)}, "
                f"schedule {' '.join(want)} (F<s>: a forward of stage s; B<s>: stage s's parameter "
                f"gradients accumulated, by a B or a W; an I is not seen)"
            )
    elif peak_live(executed) > sched.theory_peak_live(example.kind, p, m, v, r):
        judge.fail(
            f"rank {r} held {peak_live(executed)} microbatch activations at once{which}, more than {example.kind} allows "
            f"({sched.theory_peak_live(example.kind, p, m, v, r)}): the schedule run is not the one asked "
            f"for; its order of forwards and backwards: {' '.join(executed)}"
        )
