"""The refusal check of the tensor-parallel block layers (attention, SwiGLU): built on sizes that do
not split, from_dense must raise a ValueError whose message names the dimension, its size and the
group size, before any communication."""
from __future__ import annotations

import re

from conformance.examples import Layout
from conformance.verdict import Judge


def check_refused(judge: Judge, ranks, layout: Layout, layer: str, dense: dict, options: dict, name: str,
                  size: int) -> None:
    outputs = judge.run(ranks, layout, "transformer_layers:refusal",
                        [{"layer": layer, "dense": dense, "options": options} for _ in layout.ranks])
    n = layout.size
    for rank in layout.ranks:
        raised, message = outputs[rank]["raised"], outputs[rank]["message"]
        what = f"rank {rank}: {layer} with {name} = {size} on a group of {n}"
        if raised != "ValueError":
            judge.fail(f"{what}: expected a ValueError from from_dense, " +
                       ("nothing was raised" if raised is None else f"got {raised}: {message}"))
        missing = [part for part, pattern in ((f"the dimension '{name}'", re.escape(name)), (f"its size {size}", rf"\b{size}\b"),
                                              (f"the group size {n}", rf"\b{n}\b"))
                   if not re.search(pattern, message, re.IGNORECASE)]
        if missing:
            judge.fail(f"{what}: the ValueError's message does not name {', '.join(missing)}: {message!r}")
