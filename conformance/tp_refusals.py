"""The refusal check of the tensor-parallel layers: built on sizes that do not split, from_dense must
raise a ValueError whose message names the dimension, its size and the group size, before any
communication."""

from __future__ import annotations

import re

from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.verdict import Judge


def judge_refusals(judge: Judge, outputs: dict, layout: Layout, what: str, name: str, size: int) -> None:
    """``outputs``: each member's {"raised", "message"} (a refusal program's); ``what`` the layer
    and the size, as the failure names them."""
    n = layout.size
    for rank in layout.ranks:
        raised, message = outputs[rank]["raised"], outputs[rank]["message"]
        where = f"rank {rank}: {what} on a group of {n}"
        if raised != "ValueError":
            judge.fail(
                f"{where}: expected a ValueError from from_dense, " + ("nothing was raised" if raised is None else f"got {raised}: {message}")
            )
        missing = [
            part
            for part, pattern in (
                (f"the dimension '{name}'", re.escape(name)),
                (f"its size {size}", rf"\b{size}\b"),
                (f"the group size {n}", rf"\b{n}\b"),
            )
            if not re.search(pattern, message, re.IGNORECASE)
        ]
        if missing:
            judge.fail(f"{where}: the ValueError's message does not name {', '.join(missing)}: {message!r}")


def check_refused(judge: Judge, ranks, layout: Layout, layer: str, dense: dict, options: dict, name: str, size: int) -> None:
    """The block layers (attention, SwiGLU, harness/rank/programs/transformer_layers.py)."""
    outputs = judge.run(
        ranks, layout, "transformer_layers:refusal", [{"layer": layer, "dense": dense, "options": options} for _ in layout.ranks]
    )
    judge_refusals(judge, outputs, layout, f"{layer} with {name} = {size}", name, size)
