"""The strata of test_collectives.py's drawn tests: the examples each runs first, whatever the seed
and whatever the speed (harness/driver/plugin/strata.py runs them; issue 59, item 2).

Each drawn test covers, in as few examples as its longest list of classes: every dtype it can draw
(for its op, less what the backend refuses), the whole world and groups that do not start at rank 0
(members 1..n-1 and, at four ranks or more, 1 and n-1), a root that is the layout's last member
(never rank 0, and in a group a global rank that is not its group rank), sizes that do not divide
the group and one smaller than the group, uneven all-to-all splits with zeros, and, for all_reduce's
SUM and AVG in float32 and float64, values whose sum depends on the order of addition (collective_
fixed_cases.order_sensitive_inputs), which the test's bitwise check across ranks then judges. The
classes are spread over the dtypes' examples (a cover, not a product). Where a fixed case already
holds a class on every run it is reused, not repeated: a root named by global rank in a group for
scatter and gather (test_a_rooted_collective_in_a_group_takes_its_root_as_a_global_rank), messages
above the drawn sizes (test_large_message); the strata add that class's other collectives."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallelism_conformance.conformance.collective_fixed_cases import order_sensitive_inputs
from parallelism_conformance.conformance.examples import Layout, Values, dtypes_for
from parallelism_conformance.reference.collectives import OPS

ORDER_SENSITIVE_NUMEL = 24


@dataclass(frozen=True)
class OrderSensitiveValues(Values):
    """order_sensitive_inputs for ``members`` ranks in the drawn dtype: member i's tensor is row i."""

    members: int = 3

    def tensor(self, index: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        shape = self.shape if shape is None else shape
        numel = 1
        for size in shape:
            numel *= size
        return order_sensitive_inputs(self.members, numel, self.dtype)[index].reshape(shape)

    def __str__(self) -> str:
        big = 4 / torch.finfo(self.dtype).eps
        return f"dtype={str(self.dtype).removeprefix('torch.')} shape={self.shape}, +-{big:g} and 1 per element (the sum depends on the order)"


class OrderSensitive:
    """A stratum's "pattern" pick (collective_draws.Drawer.values): the drawn values' dtype and shape,
    order-sensitive values on the layout's members."""

    def __call__(self, drawn: Values, layout: Layout) -> Values:
        return OrderSensitiveValues(drawn.dtype, drawn.shape, drawn.seed, 1.0, drawn.op, members=layout.size)

    def __str__(self) -> str:
        return "order-sensitive"


ORDER_SENSITIVE = OrderSensitive()
# per group size n: a size that does not divide it, one smaller than it, a 3-d shape
SHAPES = (lambda n: (13,), lambda n: (max(n - 1, 1),), lambda n: (2, 5, 3))
MULTIPLES = (lambda n: (5 * n,), lambda n: (n,), lambda n: (3 * n, 2))  # reduce_scatter_tensor's input
FLAT_MULTIPLES = (lambda n: (5 * n,), lambda n: (n,), lambda n: (7 * n,))  # the equivalence's one dimension


def member_layouts(world: int) -> list[Layout]:
    """The whole world, then groups that do not start at rank 0."""
    layouts = [Layout(world)]
    if world >= 3:
        layouts.append(Layout(world, tuple(range(1, world))))
    if world >= 4:
        layouts.append(Layout(world, (1, world - 1)))
    return layouts


def uneven_splits(n: int) -> list[list[int]]:
    """Row i: what member i sends to each member; zeros and unequal sizes (row 0 sends 0 to itself)."""
    return [[(3 * i + j) % 5 for j in range(n)] for i in range(n)]


def cover(fixtures, collective: str, op=None, *, root=None, shapes=SHAPES, shape_label="shape", splits=None, order_sensitive=False):
    """One stratum per dtype the test can draw (at least one per layout and shape), the other classes
    spread over them."""
    world = fixtures["target"].max_world_size
    if world < 2:
        return []
    dtypes = dtypes_for(op, fixtures["backend_refusals"].dtypes(collective, op))
    layouts = member_layouts(world)
    strata = []
    for k in range(max(len(dtypes), len(layouts), len(shapes or ()))):
        layout, dtype = layouts[k % len(layouts)], dtypes[k % len(dtypes)] if dtypes else None
        stratum = {"layout": layout, "dtype": dtype}
        if shapes:
            stratum[shape_label] = shapes[k % len(shapes)](layout.size)
        if root:
            stratum[root] = layout.ranks[-1]
        if splits:
            stratum[splits] = uneven_splits(layout.size)
        if order_sensitive and dtype in (torch.float32, torch.float64) and op in ("SUM", "AVG"):
            stratum.update({shape_label: (ORDER_SENSITIVE_NUMEL,), "pattern": ORDER_SENSITIVE})
        strata.append({k: v for k, v in stratum.items() if v is not None})
    return strata


def per_op(fixtures, collective: str, *, root=None, op_label="op", shapes=SHAPES, shape_label="shape"):
    """For a test that draws its op: one stratum per op, each with a dtype of that op not yet
    covered where one is left (the eight ops then cover the eight dtypes)."""
    world = fixtures["target"].max_world_size
    if world < 2:
        return []
    layouts, covered, strata = member_layouts(world), set(), []
    for k, op in enumerate(OPS):
        dtypes = dtypes_for(op, fixtures["backend_refusals"].dtypes(collective, op))
        if not dtypes:
            continue
        dtype = next((d for d in dtypes if d not in covered), dtypes[k % len(dtypes)])
        covered.add(dtype)
        layout = layouts[k % len(layouts)]
        stratum = {"layout": layout, op_label: op, "dtype": dtype, shape_label: shapes[k % len(shapes)](layout.size)}
        if root:
            stratum[root] = layout.ranks[-1]
        strata.append(stratum)
    return strata


def _op(params) -> str:
    return params["op"]


STRATA = {
    "test_broadcast": lambda f, p: cover(f, "broadcast", root="src"),
    "test_reduce": lambda f, p: cover(f, "reduce", _op(p), root="dst"),
    "test_all_reduce": lambda f, p: cover(f, "all_reduce", _op(p), order_sensitive=True),
    "test_scatter": lambda f, p: cover(f, "scatter", root="src"),
    "test_gather": lambda f, p: cover(f, "gather", root="dst"),
    "test_all_gather": lambda f, p: cover(f, "all_gather"),
    "test_all_gather_into_tensor": lambda f, p: cover(f, "all_gather_into_tensor"),
    "test_reduce_scatter": lambda f, p: cover(f, "reduce_scatter", _op(p)),
    "test_reduce_scatter_tensor": lambda f, p: cover(f, "reduce_scatter_tensor", _op(p), shapes=MULTIPLES),
    # all_to_all's shapes come from its splits; with a dtype gloo takes in equal sizes only, the test draws one size
    "test_all_to_all": lambda f, p: cover(f, "all_to_all", shapes=None, splits="sizes"),
    "test_all_to_all_single": lambda f, p: cover(f, "all_to_all_single", shapes=None, splits="input_split_sizes"),
    "test_all_reduce_equals_reduce_scatter_then_all_gather": lambda f, p: per_op(f, "all_reduce", shapes=FLAT_MULTIPLES),
    "test_reduce_at_dst_equals_all_reduce": lambda f, p: per_op(f, "reduce", root="dst"),
    "test_all_to_all_twice_with_transposed_splits_is_identity": lambda f, p: cover(
        f, "all_to_all_single", shapes=None, splits="input_split_sizes"
    ),
    "test_scatter_then_gather_returns_the_roots_list": lambda f, p: cover(f, "scatter", root="root"),
}
