"""Reference (oracle) semantics of the collectives, computed in one process.

Every function takes a Python list indexed by rank and returns a list indexed
by rank. Inputs are never mutated and outputs never alias inputs (everything
returned is a fresh clone). Semantics follow the MPI standard (MPI-4.0,
chapter 6, "Collective Communication") as specialised by the PyTorch
distributed documentation (``all_reduce``, ``reduce_scatter_tensor``,
``all_to_all_single`` and friends) and NCCL (integer ``ncclAvg``).

Reduction ops are plain strings (see ``OPS``); this module deliberately does
not use torch's distributed ``ReduceOp``.
"""

from __future__ import annotations

import torch
from torch import Tensor

OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
BITWISE_OPS = ("BAND", "BOR", "BXOR")
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
)


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------


def _check_same(tensors: list[Tensor], what: str = "tensors") -> None:
    """Raise ValueError unless ``tensors`` is non-empty with one shape and dtype."""
    if len(tensors) == 0:
        raise ValueError(f"{what}: empty list (world size must be >= 1)")
    shape, dtype = tensors[0].shape, tensors[0].dtype
    for rank, t in enumerate(tensors):
        if t.shape != shape or t.dtype != dtype:
            raise ValueError(f"{what}: rank {rank} has shape {tuple(t.shape)} dtype {t.dtype}, rank 0 has shape {tuple(shape)} dtype {dtype}")


def _check_rank(rank: int, world_size: int, name: str) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"{name}={rank} is not a rank of a world of size {world_size}")


def _check_square(lists: list[list[Tensor]], what: str) -> int:
    """Raise ValueError unless ``lists`` is n lists of n tensors; return n."""
    n = len(lists)
    if n == 0:
        raise ValueError(f"{what}: empty list (world size must be >= 1)")
    for rank, row in enumerate(lists):
        if len(row) != n:
            raise ValueError(f"{what}: rank {rank} passed {len(row)} tensors, world size is {n}")
    return n


# --------------------------------------------------------------------------
# reduction
# --------------------------------------------------------------------------


def op_applies(op: str, dtype: torch.dtype) -> bool:
    """True when reduction ``op`` is defined for ``dtype``.

    Bitwise ops (BAND, BOR, BXOR) apply only to integer dtypes (MPI-4.0 §6.9.2:
    "bitwise and/or/xor" are for integer types); every other op applies to
    every dtype in ``DTYPES``. Unknown ops and dtypes outside ``DTYPES``
    (e.g. torch.bool, complex) give False.
    """
    if op not in OPS or dtype not in DTYPES:
        return False
    if op in BITWISE_OPS:
        return not dtype.is_floating_point
    return True


def reduce_values(tensors: list[Tensor], op: str) -> Tensor:
    """Elementwise reduction ``out[j] = x_0[j] (op) x_1[j] (op) ... (op) x_{n-1}[j]``.

    This is the value MPI_Reduce / all_reduce deliver (MPI-4.0 §6.9.1).

    * Floating dtypes: computed in float64, then cast once to the dtype.
      SUM = sum_i x_i, AVG = (sum_i x_i) / n, PRODUCT = prod_i x_i, MIN, MAX.
    * Integer dtypes: computed in the dtype itself, so SUM and PRODUCT wrap
      modulo 2**bits exactly like torch integer arithmetic (wrapping is
      associative and commutative, so the order does not matter).
      AVG = trunc(wrapped SUM / n), i.e. rounding toward zero (NCCL ncclAvg).
      BAND/BOR/BXOR are bitwise.

    Raises ValueError on an empty list, mismatched shapes/dtypes, or an op that
    does not apply to the dtype (see ``op_applies``).
    """
    _check_same(tensors)
    dtype = tensors[0].dtype
    if not op_applies(op, dtype):
        raise ValueError(f"reduction op {op!r} does not apply to dtype {dtype}")
    n = len(tensors)

    # Every combine below is out-of-place, so the inputs are never mutated.
    if dtype.is_floating_point:
        values = [t.to(torch.float64) for t in tensors]
    else:
        values = list(tensors)

    combine = {
        "SUM": torch.add,
        "AVG": torch.add,
        "PRODUCT": torch.mul,
        "MIN": torch.minimum,
        "MAX": torch.maximum,
        "BAND": torch.bitwise_and,
        "BOR": torch.bitwise_or,
        "BXOR": torch.bitwise_xor,
    }[op]
    acc = values[0].clone()
    for v in values[1:]:
        acc = combine(acc, v)

    if op == "AVG":
        if dtype.is_floating_point:
            acc = acc / n
        else:
            acc = torch.div(acc, n, rounding_mode="trunc")
    return acc.to(dtype)


# --------------------------------------------------------------------------
# collectives
# --------------------------------------------------------------------------


def broadcast(tensors: list[Tensor], src: int) -> list[Tensor]:
    """Broadcast: ``out[r] = x_src`` for every rank r (MPI_Bcast, MPI-4.0 §6.4)."""
    _check_rank(src, len(tensors), "src")
    return [tensors[src].clone() for _ in tensors]


def reduce(tensors: list[Tensor], dst: int, op: str) -> list[Tensor | None]:
    """Reduce: ``out[dst] = reduce_values(x, op)``; other ranks None (MPI_Reduce, §6.9.1).

    Non-destination ranks' buffers are unspecified in torch's reduce docs, so
    the oracle makes no claim about them (None).
    """
    _check_rank(dst, len(tensors), "dst")
    result = reduce_values(tensors, op)
    return [result.clone() if r == dst else None for r in range(len(tensors))]


def all_reduce(tensors: list[Tensor], op: str) -> list[Tensor]:
    """All-reduce: ``out[r] = reduce_values(x, op)`` for every r (MPI_Allreduce, §6.9.6)."""
    result = reduce_values(tensors, op)
    return [result.clone() for _ in tensors]


def scatter(scatter_list: list[Tensor], src: int, world_size: int) -> list[Tensor]:
    """Scatter: ``out[r] = scatter_list[r]`` where scatter_list is src's list (MPI_Scatter, §6.6)."""
    _check_rank(src, world_size, "src")
    if len(scatter_list) != world_size:
        raise ValueError(f"scatter_list has {len(scatter_list)} tensors, world size is {world_size}")
    return [scatter_list[r].clone() for r in range(world_size)]


def gather(tensors: list[Tensor], dst: int) -> list[list[Tensor] | None]:
    """Gather: ``out[dst] = [x_0, ..., x_{n-1}]``; other ranks None (MPI_Gather, §6.5)."""
    _check_rank(dst, len(tensors), "dst")
    return [[t.clone() for t in tensors] if r == dst else None for r in range(len(tensors))]


def all_gather(tensors: list[Tensor]) -> list[list[Tensor]]:
    """All-gather: ``out[r] = [x_0, ..., x_{n-1}]`` for every r (MPI_Allgather, §6.7)."""
    if len(tensors) == 0:
        raise ValueError("tensors: empty list (world size must be >= 1)")
    return [[t.clone() for t in tensors] for _ in tensors]


def all_gather_into_tensor(tensors: list[Tensor]) -> list[Tensor]:
    """All-gather into one tensor: ``out[r] = cat([x_0, ..., x_{n-1}], dim=0)``.

    Output shape is ``(n * x.shape[0], *x.shape[1:])``; inputs must share shape
    and dtype and have at least one dimension (ValueError otherwise).
    """
    _check_same(tensors)
    if tensors[0].dim() == 0:
        raise ValueError("all_gather_into_tensor needs inputs with dim >= 1, got 0-d")
    result = torch.cat(tensors, dim=0)
    return [result.clone() for _ in tensors]


def reduce_scatter(input_lists: list[list[Tensor]], op: str) -> list[Tensor]:
    """Reduce-scatter: ``out[r] = reduce_values([input_lists[i][r] for i], op)``.

    ``input_lists[i]`` is rank i's list of n tensors (MPI_Reduce_scatter, §6.10.1).
    """
    n = _check_square(input_lists, "input_lists")
    return [reduce_values([input_lists[i][r] for i in range(n)], op) for r in range(n)]


def reduce_scatter_tensor(tensors: list[Tensor], op: str) -> list[Tensor]:
    """Reduce-scatter of one tensor: ``out[r] = chunk_r(reduce_values(x, op))``.

    Each input has shape ``(n*k, ...)``; chunk_r is rows ``[r*k, (r+1)*k)``
    (MPI_Reduce_scatter_block, §6.10.2). ValueError if dim 0 is not divisible
    by n (or the inputs are 0-d).
    """
    _check_same(tensors)
    n = len(tensors)
    if tensors[0].dim() == 0 or tensors[0].shape[0] % n != 0:
        raise ValueError(f"reduce_scatter_tensor: input shape {tuple(tensors[0].shape)} has no dim 0 divisible by world size {n}")
    k = tensors[0].shape[0] // n
    result = reduce_values(tensors, op)
    return [result[r * k : (r + 1) * k].clone() for r in range(n)]


def all_to_all(input_lists: list[list[Tensor]]) -> list[list[Tensor]]:
    """All-to-all: ``out[r][i] = input_lists[i][r]`` (a transpose; MPI_Alltoall, §6.8)."""
    n = _check_square(input_lists, "input_lists")
    return [[input_lists[i][r].clone() for i in range(n)] for r in range(n)]


def output_split_sizes(input_split_sizes: list[list[int]]) -> list[list[int]]:
    """Output split sizes of all_to_all_single: ``out[r][i] = input_split_sizes[i][r]``."""
    n = len(input_split_sizes)
    return [[int(input_split_sizes[i][r]) for i in range(n)] for r in range(n)]


def all_to_all_single(inputs: list[Tensor], input_split_sizes: list[list[int]] | None) -> list[Tensor]:
    """All-to-all of one tensor: ``out[r] = cat([piece(i, r) for i in ranks], dim=0)``.

    piece(i, r) is the r-th slice of ``inputs[i]`` along dim 0 when it is split
    by ``input_split_sizes[i]`` (n ints summing to ``inputs[i].shape[0]``)
    (MPI_Alltoallv, §6.8). ``input_split_sizes=None`` means equal splits, as in
    torch's all_to_all_single. Inputs need dim >= 1, one dtype and the same
    trailing shape ``shape[1:]``.
    """
    n = len(inputs)
    if n == 0:
        raise ValueError("inputs: empty list (world size must be >= 1)")
    for rank, t in enumerate(inputs):
        if t.dim() == 0:
            raise ValueError(f"all_to_all_single: rank {rank} input is 0-d")
        if t.dtype != inputs[0].dtype or t.shape[1:] != inputs[0].shape[1:]:
            raise ValueError(
                f"all_to_all_single: rank {rank} has shape {tuple(t.shape)} dtype "
                f"{t.dtype}, rank 0 has shape {tuple(inputs[0].shape)} dtype "
                f"{inputs[0].dtype}"
            )
    if input_split_sizes is None:
        input_split_sizes = []
        for rank, t in enumerate(inputs):
            if t.shape[0] % n != 0:
                raise ValueError(
                    f"all_to_all_single: rank {rank} dim 0 ({t.shape[0]}) is not divisible by world size {n} and no splits were given"
                )
            input_split_sizes.append([t.shape[0] // n] * n)
    if len(input_split_sizes) != n:
        raise ValueError(f"input_split_sizes has {len(input_split_sizes)} rows, world size is {n}")
    pieces = []
    for rank, (t, splits) in enumerate(zip(inputs, input_split_sizes)):
        splits = [int(s) for s in splits]
        if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != t.shape[0]:
            raise ValueError(f"all_to_all_single: rank {rank} splits {splits} are not {n} non-negative ints summing to dim 0 = {t.shape[0]}")
        pieces.append(torch.split(t, splits, dim=0))
    return [torch.cat([pieces[i][r] for i in range(n)], dim=0) for r in range(n)]
