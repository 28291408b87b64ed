"""What the collectives of impls/collectives.py share with torch.distributed's API: the group (its
members and this rank's place), roots given as global or group ranks, flat contiguous buffers, the
argument checks every rank can make before any message is sent, and the completed work handle."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _Comm:
    """This process's view of a group: its global ranks and our group rank."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    me: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, group_rank: int) -> int:
        """Global rank of group rank ``group_rank`` (taken modulo the size)."""
        return self.ranks[group_rank % self.size]


def _comm(group: dist.ProcessGroup | None) -> _Comm | None:
    """The group as seen from this process, or ``None`` if we are not a member."""
    if group is not None and group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    rank = dist.get_rank()
    if rank not in ranks:
        return None
    return _Comm(group, ranks, ranks.index(rank))


def _check_root_args(fn: str, name: str, global_rank: int | None, group_rank: int | None) -> None:
    """Refuse ``src`` and ``group_src`` (or ``dst`` and ``group_dst``) together."""
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"{fn}: specify at most one of {name}={global_rank} and group_{name}={group_rank}")


def _root(comm: _Comm, fn: str, name: str, global_rank: int | None, group_rank: int | None) -> int:
    """The root's group rank, from a global rank, a group rank, or the default 0."""
    if group_rank is not None:
        if not 0 <= group_rank < comm.size:
            raise ValueError(f"{fn}: group_{name}={group_rank} is not a rank of a group of size {comm.size}")
        return group_rank
    if global_rank is not None:
        if global_rank not in comm.ranks:
            raise ValueError(f"{fn}: {name}={global_rank} is not a member of the group (ranks {list(comm.ranks)})")
        return comm.ranks.index(global_rank)
    return 0


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A flat contiguous view of ``tensor`` (a copy if it is not contiguous)."""
    return (tensor if tensor.is_contiguous() else tensor.contiguous()).view(-1)


def _store(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy results computed in ``flat`` back into ``tensor`` if ``flat`` was a copy."""
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


def _split_sizes(numel: int, n: int) -> list[int]:
    """``torch.tensor_split`` chunk sizes: ``n`` sizes differing by at most one."""
    q, r = divmod(numel, n)
    return [q + 1] * r + [q] * (n - r)


def _check_dtype(fn: str, name: str, tensor: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if tensor.dtype != ref.dtype:
        raise ValueError(f"{fn}: {name} has dtype {tensor.dtype} but {ref_name} has dtype {ref.dtype}")


def _check_list(fn: str, name: str, tensors: Sequence[torch.Tensor], n: int) -> None:
    if tensors is None:
        raise ValueError(f"{fn}: {name} is None but must be a list of group size {n} tensors")
    if len(tensors) != n:
        raise ValueError(f"{fn}: {name} has length {len(tensors)} but the group size is {n}")


def _check_list_entries(fn: str, name: str, tensors: Sequence[torch.Tensor], ref_name: str, ref: torch.Tensor) -> None:
    """Every entry must have ``ref``'s dtype and number of elements."""
    for k, t in enumerate(tensors):
        _check_dtype(fn, f"{name}[{k}]", t, ref_name, ref)
        if t.numel() != ref.numel():
            raise ValueError(f"{fn}: {name}[{k}] has {t.numel()} elements but {ref_name} has {ref.numel()}")


def _check_list_dtypes(fn: str, name: str, tensors: Sequence[torch.Tensor], ref_name: str, ref: torch.Tensor) -> None:
    """Every entry must have ``ref``'s dtype (sizes may differ)."""
    for k, t in enumerate(tensors):
        _check_dtype(fn, f"{name}[{k}]", t, ref_name, ref)


def _check_numel(fn: str, name: str, tensor: torch.Tensor, expected: int, why: str) -> None:
    if tensor.numel() != expected:
        raise ValueError(f"{fn}: {name} has {tensor.numel()} elements but must have {expected} ({why})")


def _row_splits(fn: str, name: str, tensor: torch.Tensor, splits, n: int) -> list[int]:
    """Validated dim-0 split sizes for ``tensor`` (equal pieces if ``splits`` is empty)."""
    rows = tensor.shape[0]
    if not splits:
        if rows % n != 0:
            raise ValueError(f"{fn}: {name}.shape[0]={rows} is not divisible by the group size {n} and {name}_split_sizes was not given")
        return [rows // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n:
        raise ValueError(f"{fn}: {name}_split_sizes has length {len(splits)} but the group size is {n}")
    if any(s < 0 for s in splits):
        raise ValueError(f"{fn}: {name}_split_sizes {splits} contains a negative size")
    if sum(splits) != rows:
        raise ValueError(f"{fn}: {name}_split_sizes sum to {sum(splits)} but {name}.shape[0] is {rows}")
    return splits


class _CompletedWork:
    """What ``async_op=True`` returns: the work was already done synchronously."""

    def __init__(self, result: list[torch.Tensor]):
        self._result = result

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        return None

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future

    def __repr__(self) -> str:
        return "_CompletedWork()"


def _done(async_op: bool, result: list[torch.Tensor]) -> _CompletedWork | None:
    return _CompletedWork(result) if async_op else None
