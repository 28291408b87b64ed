"""Perturbed completion (--perturb-timing), driver side: the delay schedule of each task, drawn
by Hypothesis as part of the example (so it shrinks and replays with it), and what the ranks'
results say about a result read before its call completed.

A rank's schedule is (the delays of its first calls, the delay of every later call), each 0,
SHORT or LONG (harness/rank/perturbation.py says what each does). Hypothesis shrinks a list
towards fewer elements and each choice towards its first value: 0 for the first calls, SHORT for
the tail (TAIL says why): a failing schedule shrinks to the shortest prefix and the shortest
delays that still fail. The rank numbers its calls per task, so the schedule
of rank r is rank-specific: ranks drift apart.
"""

from __future__ import annotations

import torch
from hypothesis import note
from hypothesis import strategies as st

from parallelism_conformance.harness.rank import poison
from parallelism_conformance.harness.rank.perturbation import NAMES

DELAYS = st.sampled_from((0, 1, 2))
MAX_LINES = 4  # of a failure's calls, named one per line
# the tail's simplest value is SHORT: the first example Hypothesis tries (its simplest) delays every
# call, so a result read before its wait fails there, named, whatever the backend's timing; a
# failure then shrinks to the shortest prefix and the fewest LONG delays that still fail
TAIL = st.sampled_from((1, 0, 2))
SCHEDULE = st.tuples(st.lists(DELAYS, max_size=8), TAIL)
# --perturb-timing every: no call runs as the backend runs it (no 0). Under on, a call drawn 0 completes
# as gloo completes it, and a result read before its wait is then whatever gloo's thread had written:
# the same example of a race mutant failed on such garbled values, naming no call, in 2 of 3 runs
LATE = st.sampled_from((1, 2))
EVERY_CALL_LATE = st.tuples(st.lists(LATE, max_size=8), LATE)


class ReadBeforeCompletion(AssertionError):
    """A rank's result holds the poison of a call that had not completed when the program read it,
    or a buffer was changed while its send was in flight:
    an AssertionError, so that Hypothesis shrinks the example (the schedule with it) and replays it."""


def draw(world_size: int, every_call: bool = False) -> list | None:
    """One schedule per rank for the next task, drawn from the running Hypothesis example (with
    ``every_call``, one that delays every call); None outside one (a test without @given, the
    suite's own probes): that task runs unperturbed."""
    from hypothesis.control import current_build_context
    from hypothesis.errors import InvalidArgument

    try:
        data = current_build_context().data
    except InvalidArgument:
        return None
    schedules = [data.draw(EVERY_CALL_LATE if every_call else SCHEDULE) for _ in range(world_size)]
    note(f"--perturb-timing: {describe(schedules)}")
    return schedules


def describe(schedules: list | None) -> str:
    """``rank 0: calls 0-1 short, long, then none; rank 1: none`` (a call's number counts from 0 in the task)."""
    if not schedules:
        return "no delays"
    parts = []
    for rank, (prefix, tail) in enumerate(schedules):
        if not any(prefix) and tail == 0:
            parts.append(f"rank {rank}: none")
            continue
        named = ", ".join(NAMES[d] for d in prefix)
        first = f"calls 0-{len(prefix) - 1} {named}, then " if prefix else ""
        parts.append(f"rank {rank}: {first}every later call {NAMES[tail]}")
    return "delay schedule " + "; ".join(parts)


def poisoned_reads(outputs: list, late: list, schedules: list | None) -> str | None:
    """The failure's message when a rank's result holds poison, naming the call it came from, or a
    send's buffer changed while it was in flight; None when neither. ``outputs`` and ``late``: per rank, its result and its table of delayed calls."""
    calls = {(c["rank"], c["call"]): c for table in late for c in table if isinstance(c, dict)}
    lines = [
        f"{_call(c)} had its buffer changed after the call and before "
        + (
            "the data left: what it sent is what the buffer held then, not at the call"
            if c["delay"] == "long"
            else "its wait(): the backend may send either (gloo and NCCL read a send's buffer until it completes)"
        )
        for c in calls.values()
        if c.get("changed")
    ]
    lines += [
        f"{_call(c)} had its output written by the program while the call was in flight: the result it "
        f"delivered at completion replaced that write (a backend may as well keep either)"
        for c in calls.values()
        if c.get("overwritten")
    ]
    for rank, output in enumerate(outputs):
        named, unnamed = set(), 0
        for tensor in _tensors(output):
            pairs, count = poison.found(tensor)
            named |= pairs
            unnamed += count
        for source, index in sorted(named):
            call = calls.get((source, index))
            if call is None:  # a pattern nobody poisoned: an unrelated value that looks like one is not evidence
                continue
            lines.append(f"rank {rank}'s result holds the poison of {_call(call)}: its result was read before it completed")
        if unnamed and not named:
            pending = [c for c in calls.values() if c["state"] != "completed" and c.get("outputs")]
            if pending:
                lines.append(
                    f"rank {rank}'s result holds {unnamed} half-precision NaN while these calls had not completed: "
                    + "; ".join(_call(c) for c in pending)
                )
    if not lines:
        return None
    if len(lines) > MAX_LINES:
        lines = [*lines[:MAX_LINES], f"and {len(lines) - MAX_LINES} more like these"]
    return "a race, found by --perturb-timing: " + "\n  ".join(lines) + f"\n  {describe(schedules)}"


def late_note(late: list) -> str:
    """For a failure on values: the delayed calls the program had not waited for when it returned."""
    pending = [c for table in late for c in table if isinstance(c, dict) and c.get("state") != "completed"]
    if not pending:
        return ""
    shown = "; ".join(_call(c) for c in pending[:6]) + (f"; and {len(pending) - 6} more" if len(pending) > 6 else "")
    return f"\n  --perturb-timing: calls not yet completed when the program returned: {shown}"


def _call(call: dict) -> str:
    how = f", completed by {call['how']}" if call.get("how") else f", {call['state']} when the program returned"
    return f"rank {call['rank']}'s {call['op']} (call {call['call']} of the task, delayed {call['delay']}, made at {call['where']}{how})"


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        out = []
        for item in value:
            out.extend(_tensors(item))
        return out
    return []
