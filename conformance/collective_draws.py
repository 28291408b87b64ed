"""How the collectives' drawn tests draw an example (test_collectives.py): its parts printed with
every failure, the dtypes a backend refuses left out, a stratum's forced picks taken
(collective_strata.py), and the checks every out-of-place call shares."""

from __future__ import annotations

import pytest
from hypothesis import event
from hypothesis import strategies as st

from parallelism_conformance.conformance.examples import Layout, Values, dtypes_for, layouts, values
from parallelism_conformance.conformance.verdict import Judge


class Drawer:
    """Draws the parts of one example from Hypothesis's ``data`` and builds a Judge that prints them.

    In a stratum's example (harness/driver/plugin/strata.py), ``data.stratum`` holds its forced
    picks: labels of draws ("layout", "src", "shape") come forced from ``data.draw`` itself; here,
    "dtype" (the one drawn among those allowed, else the stratum does not apply) and "pattern"
    (collective_strata.ORDER_SENSITIVE: values whose sum depends on the order of addition)."""

    def __init__(self, data, *, target, refusals, nodeid: str):
        self.data, self.target, self.refusals, self.nodeid = data, target, refusals, nodeid
        self.parts: list[str] = []
        self.stratum: dict = getattr(data, "stratum", None) or {}
        self.drawn_layout: Layout | None = None

    def layout(self, min_size: int = 1) -> Layout:
        layout = self.drawn_layout = self.data.draw(layouts(self.target.max_world_size, min_size), label="layout")
        event(f"world_size={layout.world_size}, group of {layout.size}" if layout.members else f"world_size={layout.world_size}, whole world")
        self.parts.append(str(layout))
        return layout

    def values(self, collective: str, op: str | None = None, shape=None) -> Values:
        allowed = dtypes_for(op, self.refusals.dtypes(collective, op))
        if not allowed:
            pytest.skip(f"the {self.refusals.backend} backend refuses {collective} op={op} for every dtype")
        if "dtype" in self.stratum:
            if self.stratum["dtype"] not in allowed:
                pytest.skip(f"{self.stratum['dtype']} is not drawn for {collective} op={op} here (refused by the backend, or the op)")
            allowed = [self.stratum["dtype"]]
        shape = self.stratum.get("shape") if shape is None else shape
        drawn = self.data.draw(values(allowed, op, shape), label="values")
        if self.stratum.get("pattern") is not None:  # a pattern of values for the drawn dtype and shape
            drawn = self.stratum["pattern"](drawn, self.drawn_layout)
        self.parts.append(str(drawn) + (f" op={op}" if op else ""))
        return drawn

    def pick(self, name: str, strategy):
        value = self.data.draw(strategy, label=name)
        self.parts.append(f"{name}={value}")
        return value

    def judge(self) -> Judge:
        return Judge(", ".join(self.parts), self.target.reproduce(self.nodeid))


def check_inputs_unchanged(judge: Judge, outputs: dict, layout: Layout, name: str, sent: list) -> None:
    for i, rank in enumerate(layout.ranks):
        if sent[i] is None:
            continue
        what = f"rank {rank} input '{name}' after the call (an out-of-place collective must not modify it)"
        if isinstance(sent[i], list):
            judge.tensors(outputs[rank][name], sent[i], what=what)
        else:
            judge.tensor(outputs[rank][name], sent[i], what=what)


def split_sizes(n: int) -> st.SearchStrategy:
    """n x n split sizes: row i is what rank i sends to each peer; zeros and unequal sizes included."""
    return st.lists(st.lists(st.integers(0, 50), min_size=n, max_size=n), min_size=n, max_size=n)
