"""The memory half of ``--parallelize``'s cost (issue 57, item 4): what each rank holds after the
first step against what the parameters' placements claim. Judged in the driver from the plain data
each rank returns (harness/rank/programs/parallelize.py, ``held``), after the values: a cost
finding never hides a wrong value, and a wrong value is failed before any cost is said.

Per rank, held = the sum, over the model's parameters, of the local bytes (numel x itemsize of
``to_local()`` for a DTensor, else the tensor) of the parameter, its gradient and each of its
optimizer-state tensors, plus every buffer's. The claim (reference/parallelize.py, ``claimed_bytes``):
each parameter's largest shard under its own placements,

    claim(t) = itemsize * prod_d ceil(shape[d] / prod_{mesh dims sharding d} size),

Replicate and Partial dimensions dividing nothing, a plain tensor claimed whole. A gradient and an
optimizer-state tensor of the parameter's shape are claimed as the parameter is (a plan that shards
a parameter claims its gradient and moments sharded alike); a state tensor of another shape (AdamW's
``step``) is claimed whole; a buffer the dense model also has is claimed by its own placements, one
it does not (an extra copy the plan keeps) is claimed 0 bytes.

The verdict: held > claim on any rank (the ceil, one row per sharded dimension, is the only
allowance) is *costs more*: the ratio held / claim of the rank with the largest, and the tensors
above their claim, reported beside a pass (RunState.costs: the test reads "costs more"), a failure
only under ``--require-bounds yes``. A rank holding less than its claim is not judged: the claim is
the largest shard, and a rank of an uneven shard legitimately holds less (even nothing); placements
that lie about the split show as wrong gathered values, which the step checks fail first."""

from __future__ import annotations

from parallelism_conformance.reference.parallelize import claimed_bytes

KINDS = ("parameter", "gradient", "optimizer state", "buffer")


def _claim(record: dict, like: dict | None = None) -> int:
    """The claim of one tensor's record, by ``like``'s placements where it has the same shape."""
    if like is not None and list(record["shape"]) == list(like["shape"]):
        return claimed_bytes(like["shape"], record["itemsize"], like["placements"], like["sizes"])
    if like is not None:  # another shape: whole
        return claimed_bytes(record["shape"], record["itemsize"], {}, {})
    return claimed_bytes(record["shape"], record["itemsize"], record["placements"], record["sizes"])


def _placed(record: dict, like: dict) -> str:
    """' (placed X, its parameter Y)' where a gradient's or a state's placements are not its parameter's."""
    show = lambda r: ", ".join(f"{p} on {d}" for d, p in r["placements"].items()) or "a plain tensor"
    return "" if record["placements"] == like["placements"] else f" (placed {show(record)}; its parameter {show(like)})"


def account(memory: dict, dense_buffers: set[str]) -> list[tuple[str, str, int, int, str]]:
    """[(kind, name, held bytes, claimed bytes, how it is placed where not as its parameter)] of one
    rank's ``memory`` record."""
    rows = []
    for name, param in memory["params"].items():
        rows.append(("parameter", name, param["local"], _claim(param), ""))
        grad = memory["grads"].get(name)
        if grad is not None:
            rows.append(("gradient", name, grad["local"], _claim(grad, param), _placed(grad, param)))
        for state in memory["optimizer"].get(name, []):
            rows.append(("optimizer state", name, state["local"], _claim(state, param), _placed(state, param)))
    for name, buffer in memory["buffers"].items():
        rows.append(("buffer", name, buffer["local"], _claim(buffer) if name in dense_buffers else 0, ""))
    return rows


def findings(outputs: dict, dense_buffers: set[str]) -> tuple[float, str | None]:
    """(the largest ratio held / claim of any rank, the finding where it is above 1, else None)."""
    worst, finding = 0.0, None
    for rank in sorted(outputs):
        memory = outputs[rank].get("memory")
        if memory is None:  # no step ran: nothing held to judge
            continue
        rows = account(memory, dense_buffers)
        held, claim = sum(r[2] for r in rows), sum(r[3] for r in rows)
        ratio = held / claim if claim else float("inf") if held else 1.0
        above = [f"{kind} '{name}' {h} B against {c} B{how}" for kind, name, h, c, how in rows if h > c]
        if ratio > worst:
            worst = ratio
        if above and (finding is None or ratio > finding[0]):
            shown = "; ".join(above[:6]) + (f"; and {len(above) - 6} more" if len(above) > 6 else "")
            finding = (
                ratio,
                f"memory: rank {rank} holds {held} B of parameters, gradients, optimizer state and buffers after step 1, "
                f"{ratio:.3g}x its placements' claim ({claim} B); above it: {shown}",
            )
    return worst, None if finding is None else finding[1]


def judge_memory(judge, outputs: dict, dense_buffers: set[str], require: bool, costs: list) -> float:
    """After the values passed: the finding, if any, fails under ``require`` (--require-bounds yes),
    else goes to ``costs`` (the test's costs-more findings) once per distinct text. The ratio."""
    ratio, finding = findings(outputs, dense_buffers)
    if finding is not None and require:
        judge.fail(f"costs more than the placements claim (--require-bounds): {finding}")
    note = f"costs more ({judge.example}): {finding}"
    if finding is not None and note not in costs:
        costs.append(note)
    return ratio
