"""Self-tests of the single-process oracle in ``reference/``.

Algebraic identities between the reference collectives, checked in one
process with hypothesis. No distributed runtime is involved anywhere.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism_conformance.reference import collectives as C
from parallelism_conformance.reference.tolerance import first_mismatch, reduction_atol, unit_roundoff

REFERENCE_DIR = pathlib.Path(__file__).resolve().parent.parent / "reference"

SHAPES = [(), (0,), (1,), (3,), (7,), (2, 3), (5, 0), (3, 1, 2)]
ROW_SHAPES = [(), (1,), (3,), (2, 2)]  # trailing shapes for dim-0-stacked inputs

SETTINGS = settings(deadline=None, max_examples=60)


# --------------------------------------------------------------------------
# input generation
# --------------------------------------------------------------------------


def make_tensor(shape, dtype, gen: torch.Generator, full_range: bool) -> torch.Tensor:
    """Seeded values: scaled randn for floats; small or full-range ints."""
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
    if full_range:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)
    low = 0 if dtype == torch.uint8 else -5
    return torch.randint(low, 6, shape, generator=gen, dtype=dtype)


def make_inputs(n, shape, dtype, seed, full_range):
    gen = torch.Generator().manual_seed(seed)
    return [make_tensor(shape, dtype, gen, full_range) for _ in range(n)]


@st.composite
def cases(draw, shapes=SHAPES):
    """(world_size, dtype, op, per-rank inputs) with op applicable to dtype."""
    n = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(C.DTYPES))
    op = draw(st.sampled_from([op for op in C.OPS if C.op_applies(op, dtype)]))
    shape = draw(st.sampled_from(shapes))
    seed = draw(st.integers(0, 2**31 - 1))
    full_range = draw(st.booleans())
    return n, dtype, op, make_inputs(n, shape, dtype, seed, full_range)


def is_exact(dtype, op) -> bool:
    return not dtype.is_floating_point or op in ("MIN", "MAX")


def assert_match(actual, expected, atol=None):
    bad = first_mismatch(actual, expected, atol)
    assert bad is None, f"mismatch at index {bad[0]}: expected {bad[1]}, got {bad[2]}"


def assert_identical(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(actual, expected)


# --------------------------------------------------------------------------
# reductions
# --------------------------------------------------------------------------


@SETTINGS
@given(case=cases(), dst_frac=st.floats(0, 1, exclude_max=True))
def test_all_reduce_same_everywhere_and_equals_reduce(case, dst_frac):
    n, dtype, op, x = case
    originals = [t.clone() for t in x]
    out = C.all_reduce(x, op)
    assert len(out) == n
    for r in range(n):
        assert_identical(out[r], out[0])
    dst = int(dst_frac * n)
    reduced = C.reduce(x, dst, op)
    for r in range(n):
        if r == dst:
            assert_identical(reduced[r], out[0])
        else:
            assert reduced[r] is None
    for t, o in zip(x, originals):  # inputs untouched
        assert_identical(t, o)


@st.composite
def row_cases(draw):
    """(world_size, dtype, op, per-rank inputs of shape (n*k, *trailing), k)."""
    n, dtype, op, _ = draw(cases(shapes=[()]))
    k = draw(st.integers(0, 3))
    trailing = draw(st.sampled_from(ROW_SHAPES))
    seed = draw(st.integers(0, 2**31 - 1))
    full_range = draw(st.booleans())
    x = make_inputs(n, (n * k, *trailing), dtype, seed, full_range)
    return n, dtype, op, x, k


@SETTINGS
@given(case=row_cases())
def test_all_gather_of_reduce_scatter_is_all_reduce(case):
    n, dtype, op, x, k = case
    scattered = C.reduce_scatter_tensor(x, op)
    assert all(s.shape == (k, *x[0].shape[1:]) for s in scattered)
    gathered = C.all_gather_into_tensor(scattered)
    expected = C.all_reduce(x, op)
    for r in range(n):
        assert_identical(gathered[r], expected[r])


@SETTINGS
@given(case=row_cases())
def test_reduce_scatter_of_chunks_equals_reduce_scatter_tensor(case):
    n, dtype, op, x, k = case
    chunk_lists = [[t[r * k : (r + 1) * k] for r in range(n)] for t in x]
    by_lists = C.reduce_scatter(chunk_lists, op)
    by_tensor = C.reduce_scatter_tensor(x, op)
    for r in range(n):
        assert_identical(by_lists[r], by_tensor[r])


def test_reduce_scatter_tensor_rejects_indivisible_dim0():
    x = [torch.zeros(5) for _ in range(2)]
    with pytest.raises(ValueError):
        C.reduce_scatter_tensor(x, "SUM")
    with pytest.raises(ValueError):
        C.all_gather_into_tensor([torch.tensor(1.0)])


@SETTINGS
@given(case=cases(), perm=st.randoms(use_true_random=False))
def test_reduce_values_invariant_under_rank_permutation(case, perm):
    n, dtype, op, x = case
    order = list(range(n))
    perm.shuffle(order)
    permuted = [x[i] for i in order]
    a = C.reduce_values(x, op)
    b = C.reduce_values(permuted, op)
    if is_exact(dtype, op):
        assert_identical(b, a)
    else:
        assert_match(b, a, reduction_atol(x, op))


@SETTINGS
@given(case=cases())
def test_min_max_bound_every_input(case):
    n, dtype, _, x = case
    lo, hi = C.reduce_values(x, "MIN"), C.reduce_values(x, "MAX")
    for t in x:
        assert bool((lo <= t).all()) and bool((t <= hi).all())


@SETTINGS
@given(case=cases())
def test_float_avg_is_sum_over_n(case):
    n, dtype, _, x = case
    if not dtype.is_floating_point:
        return
    avg = C.reduce_values(x, "AVG")
    via_sum = (C.reduce_values(x, "SUM").to(torch.float64) / n).to(dtype)
    assert_match(via_sum, avg, reduction_atol(x, "AVG"))


@SETTINGS
@given(n=st.integers(1, 6), seed=st.integers(0, 10**6), dtype=st.sampled_from([d for d in C.DTYPES if not d.is_floating_point]))
def test_integer_sum_wraps_and_avg_truncates(n, seed, dtype):
    x = make_inputs(n, (4,), dtype, seed, full_range=True)
    bits = torch.iinfo(dtype).bits
    exact = [sum(vals) for vals in zip(*(t.tolist() for t in x))]  # Python ints
    total = C.reduce_values(x, "SUM")
    for got, want in zip(total.tolist(), exact):
        assert (got - want) % 2**bits == 0
        assert torch.iinfo(dtype).min <= got <= torch.iinfo(dtype).max
    avg = C.reduce_values(x, "AVG")
    expected_avg = torch.div(total, n, rounding_mode="trunc")
    assert_identical(avg, expected_avg)


def test_integer_explicit_values():
    i8 = lambda *v: [torch.tensor([a], dtype=torch.int8) for a in v]
    assert C.reduce_values(i8(100, 100), "SUM").item() == -56
    assert C.reduce_values(i8(100, 100), "AVG").item() == -28  # wrapped sum / 2
    assert C.reduce_values(i8(-3, 0), "AVG").item() == -1  # trunc, not floor (-2)
    assert C.reduce_values(i8(3, 0), "AVG").item() == 1
    assert C.reduce_values(i8(16, 16), "PRODUCT").item() == 0  # 256 wraps to 0
    assert C.reduce_values(i8(-128, -1), "SUM").item() == 127
    u8 = [torch.tensor([200], dtype=torch.uint8), torch.tensor([100], dtype=torch.uint8)]
    assert C.reduce_values(u8, "SUM").item() == 44
    assert C.reduce_values(i8(0b1100, 0b1010), "BAND").item() == 0b1000
    assert C.reduce_values(i8(0b1100, 0b1010), "BOR").item() == 0b1110
    assert C.reduce_values(i8(0b1100, 0b1010), "BXOR").item() == 0b0110


def test_float_reduction_is_single_rounding():
    # 1 + 2**-11 + 2**-11 in float16: float64 sum then one cast gives 1 + 2**-10,
    # whereas left-to-right float16 addition would round twice back to 1.
    x = [torch.tensor([v], dtype=torch.float16) for v in (1.0, 2**-11, 2**-11)]
    assert C.reduce_values(x, "SUM").item() == 1 + 2**-10


# --------------------------------------------------------------------------
# data movement
# --------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(1, 6), seed=st.integers(0, 10**6), data=st.data())
def test_all_to_all_twice_is_identity(n, seed, data):
    gen = torch.Generator().manual_seed(seed)
    lengths = data.draw(st.lists(st.integers(0, 3), min_size=n * n, max_size=n * n))
    x = [[torch.randn(lengths[i * n + r], 2, generator=gen) for r in range(n)] for i in range(n)]
    once = C.all_to_all(x)
    for r in range(n):
        for i in range(n):
            assert_identical(once[r][i], x[i][r])
    twice = C.all_to_all(once)
    for i in range(n):
        for r in range(n):
            assert_identical(twice[i][r], x[i][r])


@SETTINGS
@given(
    n=st.integers(1, 6),
    seed=st.integers(0, 10**6),
    data=st.data(),
    dtype=st.sampled_from(C.DTYPES),
    trailing=st.sampled_from([(), (2,), (1, 3)]),
)
def test_all_to_all_single_round_trip(n, seed, data, dtype, trailing):
    splits = [data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    x = [make_tensor((sum(s), *trailing), dtype, gen, True) for s in splits]
    out_splits = C.output_split_sizes(splits)
    assert out_splits == [[splits[i][r] for i in range(n)] for r in range(n)]
    out = C.all_to_all_single(x, splits)
    for r in range(n):
        assert out[r].shape == (sum(out_splits[r]), *trailing)
    back = C.all_to_all_single(out, out_splits)
    for i in range(n):
        assert_identical(back[i], x[i])


def test_all_to_all_single_equal_splits_and_bad_splits():
    x = [torch.arange(4) + 10 * i for i in range(2)]
    out = C.all_to_all_single(x, None)
    assert out[0].tolist() == [0, 1, 10, 11] and out[1].tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError):
        C.all_to_all_single(x, [[1, 2], [2, 2]])


@SETTINGS
@given(case=cases(), src_frac=st.floats(0, 1, exclude_max=True))
def test_scatter_then_gather_and_broadcast(case, src_frac):
    n, _, _, x = case
    src = int(src_frac * n)
    scattered = C.scatter(x, src, n)
    for r in range(n):
        assert_identical(scattered[r], x[r])
    gathered = C.gather(scattered, src)
    for r in range(n):
        if r == src:
            assert len(gathered[r]) == n
            for got, want in zip(gathered[r], x):
                assert_identical(got, want)
        else:
            assert gathered[r] is None
    for t in C.broadcast(x, src):
        assert_identical(t, x[src])
    for row in C.all_gather(x):
        for got, want in zip(row, x):
            assert_identical(got, want)


def test_outputs_do_not_alias_inputs():
    x = [torch.zeros(2) for _ in range(2)]
    out = C.broadcast(x, 0)
    out[1].fill_(5)
    assert x[0].tolist() == [0.0, 0.0]
    C.all_reduce(x, "SUM")[0].fill_(7)
    assert x[0].tolist() == [0.0, 0.0]


# --------------------------------------------------------------------------
# tolerance helpers and op/dtype checks
# --------------------------------------------------------------------------


@SETTINGS
@given(dtype=st.sampled_from(C.DTYPES), shape=st.sampled_from(SHAPES), seed=st.integers(0, 10**6), data=st.data())
def test_first_mismatch_finds_injected_difference(dtype, shape, seed, data):
    gen = torch.Generator().manual_seed(seed)
    expected = make_tensor(shape, dtype, gen, full_range=False)
    assert first_mismatch(expected.clone(), expected, None) is None
    numel = expected.numel()
    if numel == 0:
        return
    k = data.draw(st.integers(0, numel - 1))
    actual = expected.clone()
    flat = actual.reshape(-1)  # a view: writes go into actual
    flat[k] = flat[k] + 1 if dtype != torch.uint8 or flat[k] < 255 else 0
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(k), shape))
    bad = first_mismatch(actual, expected, torch.zeros(shape, dtype=torch.float64))
    assert bad is not None and bad[0] == index
    assert bad[1] == float(expected[index].item())
    assert bad[2] == float(actual[index].item())


def test_first_mismatch_nan_inf_and_errors():
    nan, inf = float("nan"), float("inf")
    e = torch.tensor([1.0, nan, inf, 2.0])
    assert first_mismatch(e.clone(), e, None) is None
    assert first_mismatch(torch.tensor([1.0, nan, inf, 2.5]), e, torch.full((4,), 1.0)) is None
    assert first_mismatch(torch.tensor([1.0, 0.0, inf, 2.0]), e, torch.full((4,), 9.0))[0] == (1,)
    assert first_mismatch(torch.tensor([1.0, nan, 1e30, 2.0]), e, torch.full((4,), 9.0))[0] == (2,)
    assert first_mismatch(torch.tensor([nan, nan, inf, 2.0]), e, None)[0] == (0,)
    assert first_mismatch(torch.tensor(3), torch.tensor(4), None) == ((), 4.0, 3.0)
    big = torch.tensor([2**62 + 1])
    assert first_mismatch(big, torch.tensor([2**62]), None) is not None
    with pytest.raises(ValueError):
        first_mismatch(torch.zeros(2), torch.zeros(3), None)
    with pytest.raises(ValueError):
        first_mismatch(torch.zeros(2), torch.zeros(2, dtype=torch.float64), None)


@SETTINGS
@given(case=cases())
def test_reduction_atol_zero_when_exact_positive_for_float_sum(case):
    n, dtype, op, x = case
    atol = reduction_atol(x, op)
    assert atol.dtype == torch.float64 and atol.shape == x[0].shape
    if is_exact(dtype, op):
        assert bool((atol == 0).all())
    else:
        assert bool((atol > 0).all())
    if dtype.is_floating_point:
        assert bool((reduction_atol(x, "SUM") > 0).all())
        assert unit_roundoff(dtype) == torch.finfo(dtype).eps / 2
    else:
        assert unit_roundoff(dtype) == 0.0


def test_reduction_atol_covers_low_precision_summation():
    # A left-to-right float16 sum (what an implementation might do) must be
    # within the bound of the float64-then-cast reference.
    gen = torch.Generator().manual_seed(0)
    x = [(torch.randn(1000, generator=gen) * 3).to(torch.float16) for _ in range(6)]
    acc = x[0].clone()
    for t in x[1:]:
        acc = acc + t
    assert_match(acc, C.reduce_values(x, "SUM"), reduction_atol(x, "SUM"))


def test_bitwise_ops_rejected_for_floats():
    assert not C.op_applies("BAND", torch.float32)
    assert not C.op_applies("SUM", torch.bool)
    assert C.op_applies("BAND", torch.int32) and C.op_applies("AVG", torch.bfloat16)
    with pytest.raises(ValueError, match=r"BAND.*float32"):
        C.reduce_values([torch.zeros(2)], "BAND")
    with pytest.raises(ValueError):
        C.reduce_values([], "SUM")
    with pytest.raises(ValueError):
        C.reduce_values([torch.zeros(2), torch.zeros(3)], "SUM")
    with pytest.raises(ValueError):
        C.reduce_values([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], "SUM")


def _distributed_uses(source: str) -> list[int]:
    """Line numbers where code imports or touches torch.distributed (docstrings may name it)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "distributed":
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("torch.distributed")
            and " " not in node.value
        ):
            lines.append(node.lineno)  # importlib.import_module("torch.distributed")
    return lines


def test_reference_never_imports_torch_distributed():
    files = sorted(REFERENCE_DIR.glob("**/*.py"))
    assert files, f"no .py files under {REFERENCE_DIR}"
    for path in files:
        assert _distributed_uses(path.read_text()) == [], f"{path} uses torch.distributed"


def test_the_import_guard_can_fail():
    assert _distributed_uses("import torch.distributed as dist") == [1]
    assert _distributed_uses("from torch import distributed") == [1]
    assert _distributed_uses("import torch\nx = torch.distributed.all_reduce") == [2]
    assert _distributed_uses('"""never imports torch.distributed."""') == []


def test_an_example_whose_shapes_come_from_split_sizes_does_not_print_a_placeholder_shape():
    """The all-to-all tests give each member's shape from the split sizes; their example text said
    'shape=(0, 3)' for outputs of 91 rows (reported by an outside author)."""
    from parallelism_conformance.conformance.examples import PER_MEMBER, Values

    values = Values(torch.float32, PER_MEMBER, 7)
    assert "shape=(" not in str(values) and "per member" in str(values)
    assert values.tensor(1, (4, 3)).shape == (4, 3)
    with pytest.raises(ValueError, match="pass each member's shape"):
        values.tensor(1)
