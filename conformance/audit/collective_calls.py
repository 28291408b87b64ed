"""One drawn call of each collective in an audited task (called as conformance/collective_table.py
says), and the cost model's per-rank bound for it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from parallelism_conformance.conformance.audit.common import OPS
from parallelism_conformance.conformance.collective_table import TABLE, Case
from parallelism_conformance.conformance.examples import Layout, Values, shapes
from parallelism_conformance.reference import cost_model
from parallelism_conformance.reference.collectives import DTYPES

COLLECTIVES = cost_model.COLLECTIVES


def collective_case(name: str, draw, layout: Layout, refused_for=None) -> tuple[str, list[dict], dict[int, int], str]:
    """Draw one call of collective ``name`` on ``layout``: (function, per-member arguments, per-rank
    bound in bytes, what the bound is). ``draw(label, strategy)`` draws. ``refused_for(name, op)``
    gives the dtypes the backend's own collective refuses (probed, as test_collectives.py does):
    they are not drawn, and a collective refused for every dtype is skipped with the reason."""
    n = layout.size
    op = draw("op", st.sampled_from(OPS)) if name in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor") else None
    refused = refused_for(name, op) if refused_for is not None else frozenset()
    allowed = [d for d in DTYPES if d not in refused]
    if not allowed:
        pytest.skip(
            f"the backend refuses {name}{f' op={op}' if op else ''} for every dtype (probed with "
            f"torch.distributed's own {name}), so it is not drawn"
        )
    dtype = draw("dtype", st.sampled_from(allowed))
    if dtype in refused:  # a fixed example asking for what the backend refuses
        pytest.skip(f"the backend refuses {name} for {dtype} (probed), so it is not drawn")
    itemsize = torch.empty((), dtype=dtype).element_size()
    seed = draw("seed", st.integers(0, 2**16))
    entry = TABLE[name]
    shape = draw("shape", shapes(multiple_of=n) if entry.divisible else shapes())
    vals = Values(dtype, tuple(shape), seed, op=op)
    root, splits, split_bytes = 0, None, None
    if name in ("scatter", "gather", "broadcast", "reduce"):
        root = layout.ranks.index(draw("root", st.sampled_from(layout.ranks)))
    if name == "all_to_all_single":
        splits = draw("input_split_sizes", st.lists(st.lists(st.integers(0, 50), min_size=n, max_size=n), min_size=n, max_size=n))
        inputs = [vals.tensor(i, (sum(splits[i]),)) for i in range(n)]
        split_bytes = [[s * itemsize for s in row] for row in splits]
    else:  # flat: what the audit counts is bytes, and the table cuts pieces from flat inputs
        inputs = [vals.tensor(i).reshape(-1) for i in range(n)]
    args = entry.call(inputs, Case(root, op, splits, tuple(layout.ranks)))
    numel = entry.message_numel(inputs[0].numel(), n)
    if name == "all_to_all":  # a piece of numel elements for each peer
        split_bytes = [[numel * itemsize] * n for _ in range(n)]
    bounds = {
        rank: cost_model.collective(name, n, i, numel=numel, itemsize=itemsize, split_bytes=None if split_bytes is None else split_bytes[i])
        for i, rank in enumerate(layout.ranks)
    }
    what = f"{name} on {n} ranks, {numel} x {str(dtype).removeprefix('torch.')} ({numel * itemsize} B): {BOUND_FORMULA[name]}"
    return name, args, bounds, what


BOUND_FORMULA = {  # what the sizes in the message are, and the per-rank bound (reference/cost_model.py)
    "all_reduce": "2 (numel - floor(numel/n)) itemsize, 2(n-1)/n S up to rounding",
    "reduce_scatter": "the whole input list; (numel - floor(numel/n)) itemsize = (n-1)/n S",
    "reduce_scatter_tensor": "the input; (numel - floor(numel/n)) itemsize = (n-1)/n S",
    "all_gather": "the gathered output; (n-1)/n S",
    "all_gather_into_tensor": "the gathered output; (n-1)/n S",
    "broadcast": "ceil(log2 n) S",
    "reduce": "S",
    "scatter": "one piece; (n-1) pieces",
    "gather": "one piece; (n-1) pieces",
    "all_to_all": "one piece; the rank's pieces for the other ranks",
    "all_to_all_single": "the rank's pieces for the other ranks",
}
