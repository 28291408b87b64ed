"""How far an implementation's floating reduction may sit from the oracle.

A distributed implementation reduces in the dtype's own precision, in any
order. Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed.,
§4.2: recursive summation of n terms has error <= (n-1) u sum_i |x_i| + O(u^2),
with u the unit roundoff; a product of n terms has relative error
<= (n-1) u + O(u^2) (§3.1). The bounds here add one u for the oracle's own
final cast and one u of slack. They assume no overflow to inf in the
implementation's intermediate results; the suite keeps magnitudes moderate.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parallelism_conformance.reference.collectives import _check_same, op_applies


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff u = eps / 2 (Higham §2.1) for floating dtypes; 0.0 for integers."""
    if dtype.is_floating_point:
        return torch.finfo(dtype).eps / 2
    return 0.0


def reduction_atol(tensors: list[Tensor], op: str) -> Tensor:
    """Per-element absolute tolerance (float64, shape of one input) vs ``reduce_values``.

    With n = len(tensors), u = unit_roundoff(dtype), everything in float64:

    * integer dtypes, MIN, MAX: 0 (exact; no rounding happens).
    * SUM:     (n + 1) u sum_i |x_i|                         + tiny
    * AVG:     (n + 1) u sum_i |x_i| / n  +  2 u |avg|       + tiny
    * PRODUCT: (n + 1) u prod_i |x_i|                        + tiny

    where tiny = finfo(dtype).tiny, a floor so that rounding noise near
    underflow around an exact-zero result is not flagged.
    """
    _check_same(tensors)
    dtype = tensors[0].dtype
    if not op_applies(op, dtype):
        raise ValueError(f"reduction op {op!r} does not apply to dtype {dtype}")
    shape = tensors[0].shape
    if not dtype.is_floating_point or op in ("MIN", "MAX"):
        return torch.zeros(shape, dtype=torch.float64)

    n = len(tensors)
    u = unit_roundoff(dtype)
    x = [t.to(torch.float64) for t in tensors]
    abs_sum = torch.zeros(shape, dtype=torch.float64)
    abs_prod = torch.ones(shape, dtype=torch.float64)
    total = torch.zeros(shape, dtype=torch.float64)
    for v in x:
        abs_sum = abs_sum + v.abs()
        abs_prod = abs_prod * v.abs()
        total = total + v

    if op == "SUM":
        atol = (n + 1) * u * abs_sum
    elif op == "AVG":
        atol = (n + 1) * u * abs_sum / n + 2 * u * (total / n).abs()
    else:  # PRODUCT
        atol = (n + 1) * u * abs_prod
    return atol + torch.finfo(dtype).tiny


def first_mismatch(actual: Tensor, expected: Tensor, atol: Tensor | None) -> tuple[tuple[int, ...], float | int, float | int] | None:
    """First element (row-major) where ``|actual - expected| > atol``, else None.

    Returns ``(index, expected_value, actual_value)``. ``atol`` is a float64
    tensor broadcastable to the shape, or None (= exact). Where atol is 0 the
    comparison is exact (bitwise equality for integers). NaN differs from
    everything except that an expected NaN matched by an actual NaN counts as
    equal; infinities must match exactly. Raises ValueError when shapes or
    dtypes differ. Both tensors are compared on the CPU.
    """
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise ValueError(
            f"actual has shape {tuple(actual.shape)} dtype {actual.dtype}, expected has shape {tuple(expected.shape)} dtype {expected.dtype}"
        )
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if atol is None:
        atol = torch.zeros((), dtype=torch.float64)
    atol = torch.as_tensor(atol, dtype=torch.float64).cpu()
    try:
        atol = torch.broadcast_to(atol, expected.shape)
    except RuntimeError as exc:
        raise ValueError(f"atol shape {tuple(atol.shape)} does not fit shape {tuple(expected.shape)}") from exc

    equal = actual == expected
    diff = (actual.to(torch.float64) - expected.to(torch.float64)).abs()
    # Only a positive atol may excuse a difference: for huge int64 values the
    # float64 difference can round to 0 even though the integers differ.
    within = (atol > 0) & (diff <= atol)
    ok = equal | within
    if expected.dtype.is_floating_point:
        ok = ok | (actual.isnan() & expected.isnan())

    bad = (~ok).nonzero()
    if bad.shape[0] == 0:
        return None
    index = tuple(int(i) for i in bad[0].tolist())
    number = float if expected.dtype.is_floating_point else int  # integers print as integers, exactly
    return index, number(expected[index].item()), number(actual[index].item())
