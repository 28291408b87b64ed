"""The eleven torch.distributed collectives, rebuilt from point-to-point messages.

Every function here has torch.distributed's name, signature and semantics
(torch 2.13), but moves data only with ``dist.isend`` / ``dist.irecv``.  No
torch.distributed collective is ever called; the only other torch.distributed
calls are group bookkeeping (``get_rank``, ``get_process_group_ranks``,
``GroupMember``, ``ReduceOp``).

Algorithms and costs, for a group of ``n`` ranks and ``S`` bytes of data:

* broadcast: binomial tree, ceil(log2 n) rounds, each message S bytes.
* reduce: binomial tree, ceil(log2 n) rounds; each non-root sends S bytes once.
* all_reduce: ring reduce-scatter + ring all-gather, 2(n-1) steps,
  2(n-1)/n * S bytes sent per rank; messages over SEGMENT_BYTES are cut
  into segments and pipelined.
* reduce_scatter, reduce_scatter_tensor: ring, n-1 steps,
  (n-1)/n * S bytes sent per rank (S = input size).
* all_gather, all_gather_into_tensor: ring, n-1 steps,
  (n-1)/n * S bytes sent per rank (S = output size).
* scatter, gather: linear, the root exchanges one message with each other
  member, (n-1)/n * S bytes through the root (S = the whole list).
* all_to_all, all_to_all_single: pairwise exchange, n-1 steps,
  (n-1)/n * S bytes sent per rank for equal splits.

The ring algorithms are bandwidth-optimal (Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009); the
binomial trees are latency-optimal (Thakur, Rabenseifner & Gropp,
"Optimization of collective communication operations in MPICH", IJHPCA 2005).

Conventions shared by every function:

* ``src``/``dst`` are global ranks, ``group_src``/``group_dst`` ranks within
  ``group``; at most one of a pair may be given, and if neither is, the root
  is group rank 0.
* A process that is not a member of ``group`` returns ``None`` at once.
* Reductions happen in the tensor's own dtype (like NCCL).  ``AVG`` is a
  ``SUM`` divided once, at the end, by the group size (integer dtypes use
  truncating division).  ``BAND``/``BOR``/``BXOR`` on floating or bool
  tensors raise ``ValueError``; ``PREMUL_SUM`` raises ``NotImplementedError``.
* Size, length and dtype mismatches a rank can see locally raise
  ``ValueError`` before any message is sent.
* Work is done on flat contiguous buffers; a non-contiguous caller tensor is
  computed on a contiguous copy and copied back.
* ``async_op=True`` returns an already-completed work handle (the work is done
  synchronously before returning); ``async_op=False`` returns ``None``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = [
    "broadcast",
    "reduce",
    "all_reduce",
    "scatter",
    "gather",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
]

_RedOpType = ReduceOp.RedOpType


# --------------------------------------------------------------------------
# Group bookkeeping
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Point-to-point primitive
# --------------------------------------------------------------------------


def _isend(comm: _Comm, peer: int, buf: torch.Tensor):
    """Post a send of contiguous ``buf`` to group rank ``peer`` (taken modulo the group size).
    Empty buffers are skipped (None): every caller computes sizes the same way on both ends, so
    the matching receive is skipped symmetrically."""
    if buf.numel() == 0:
        return None
    return dist.isend(buf, dst=comm.global_rank(peer), group=comm.group)


def _irecv(comm: _Comm, peer: int, buf: torch.Tensor):
    """Post a receive into contiguous ``buf`` from group rank ``peer``; None if ``buf`` is empty."""
    if buf.numel() == 0:
        return None
    return dist.irecv(buf, src=comm.global_rank(peer), group=comm.group)


def _wait(work) -> None:
    """Wait once for a posted message (gloo counts waits: a second wait on one work blocks)."""
    if work is not None:
        work.wait()


def _exchange(
    comm: _Comm,
    sends: Sequence[tuple[int, torch.Tensor]] = (),
    recvs: Sequence[tuple[int, torch.Tensor]] = (),
) -> None:
    """Post every receive and send at once, then wait for all of them."""
    works = [_irecv(comm, peer, buf) for peer, buf in recvs] + [_isend(comm, peer, buf) for peer, buf in sends]
    for work in works:
        _wait(work)


SEGMENT_BYTES = 4 << 20
"""Messages of the rings and trees larger than this are cut into segments that are pipelined: while
one segment travels, the previous one is being reduced or forwarded (gloo's ring pipelines at least
two segments per chunk the same way).  Smaller messages go whole: one message per step keeps
latency lowest."""


def _segments(chunks: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each (flat) chunk cut into the same number ``k`` of nearly equal, contiguous segments, with
    ``k`` = ceil(largest chunk / SEGMENT_BYTES).  Both ends of a message cut the same chunk the
    same way, so a segment's size is known to sender and receiver alike."""
    largest = max(c.numel() for c in chunks) * chunks[0].element_size()
    k = max(1, -(-largest // SEGMENT_BYTES))
    return [list(c.split(_split_sizes(c.numel(), k))) for c in chunks]


# --------------------------------------------------------------------------
# Reduction operators
# --------------------------------------------------------------------------

_BITWISE_OPS = (_RedOpType.BAND, _RedOpType.BOR, _RedOpType.BXOR)
_SUPPORTED_OPS = (
    _RedOpType.SUM,
    _RedOpType.AVG,
    _RedOpType.PRODUCT,
    _RedOpType.MIN,
    _RedOpType.MAX,
) + _BITWISE_OPS


def _resolve_op(fn: str, op, dtype: torch.dtype) -> _RedOpType:
    """Normalise ``op`` (ReduceOp or RedOpType) and check it suits ``dtype``."""
    kind = next((k for k in _RedOpType.__members__.values() if op == k), None)
    if kind not in _SUPPORTED_OPS:
        name = kind.name if kind is not None else repr(op)
        supported = ", ".join(k.name for k in _SUPPORTED_OPS)
        raise NotImplementedError(f"{fn}: reduction op {name} is not supported (supported: {supported})")
    if kind in _BITWISE_OPS and (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
        raise ValueError(f"op {kind.name} is not defined for dtype {dtype}")
    return kind


def _combine_(acc: torch.Tensor, incoming: torch.Tensor, kind: _RedOpType) -> None:
    """``acc = acc (op) incoming`` elementwise, in place, in acc's dtype.

    AVG combines as SUM; the division happens once, in :func:`_finish_avg_`.
    """
    if kind in (_RedOpType.SUM, _RedOpType.AVG):
        acc.add_(incoming)
    elif kind == _RedOpType.PRODUCT:
        acc.mul_(incoming)
    elif kind == _RedOpType.MIN:
        torch.minimum(acc, incoming, out=acc)
    elif kind == _RedOpType.MAX:
        torch.maximum(acc, incoming, out=acc)
    elif kind == _RedOpType.BAND:
        acc.bitwise_and_(incoming)
    elif kind == _RedOpType.BOR:
        acc.bitwise_or_(incoming)
    elif kind == _RedOpType.BXOR:
        acc.bitwise_xor_(incoming)
    else:  # _resolve_op rejects everything else first
        raise NotImplementedError(f"reduction op {kind.name} is not supported")


def _finish_avg_(buf: torch.Tensor, kind: _RedOpType, n: int) -> None:
    """For AVG, divide a fully summed buffer by ``n`` in place (trunc for ints)."""
    if kind != _RedOpType.AVG:
        return
    if buf.dtype.is_floating_point or buf.dtype.is_complex:
        buf.div_(n)
    else:
        buf.div_(n, rounding_mode="trunc")


# --------------------------------------------------------------------------
# Buffers and validation
# --------------------------------------------------------------------------


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


def _check_list_entries(
    fn: str, name: str, tensors: Sequence[torch.Tensor], ref_name: str, ref: torch.Tensor
) -> None:
    """Every entry must have ``ref``'s dtype and number of elements."""
    for k, t in enumerate(tensors):
        _check_dtype(fn, f"{name}[{k}]", t, ref_name, ref)
        if t.numel() != ref.numel():
            raise ValueError(
                f"{fn}: {name}[{k}] has {t.numel()} elements but {ref_name} has {ref.numel()}"
            )


def _check_list_dtypes(
    fn: str, name: str, tensors: Sequence[torch.Tensor], ref_name: str, ref: torch.Tensor
) -> None:
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
            raise ValueError(
                f"{fn}: {name}.shape[0]={rows} is not divisible by the group size {n} "
                f"and {name}_split_sizes was not given"
            )
        return [rows // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n:
        raise ValueError(f"{fn}: {name}_split_sizes has length {len(splits)} but the group size is {n}")
    if any(s < 0 for s in splits):
        raise ValueError(f"{fn}: {name}_split_sizes {splits} contains a negative size")
    if sum(splits) != rows:
        raise ValueError(f"{fn}: {name}_split_sizes sum to {sum(splits)} but {name}.shape[0] is {rows}")
    return splits


# --------------------------------------------------------------------------
# Building blocks: binomial trees and rings
# --------------------------------------------------------------------------


def _tree_links(n: int, rel: int) -> tuple[int | None, list[int]]:
    """The binomial tree over relative ranks 0..n-1 rooted at 0: ``rel``'s parent is
    ``rel - 2^k`` where ``2^k`` is its lowest set bit (None for the root), and its children are
    ``rel + 2^j`` for every ``2^j < 2^k`` with ``rel + 2^j < n``, smallest first."""
    low = rel & -rel if rel else 1 << max(n - 1, 1).bit_length()
    parent = rel - low if rel else None
    children = []
    mask = 1
    while mask < low and rel + mask < n:
        children.append(rel + mask)
        mask <<= 1
    return parent, children


def _tree_broadcast(comm: _Comm, buf: torch.Tensor, root: int) -> None:
    """Binomial-tree broadcast of ``buf`` from group rank ``root``: ceil(log2 n) rounds
    (Thakur, Rabenseifner & Gropp 2005).  Pipelined by segments (:data:`SEGMENT_BYTES`): a
    rank forwards segment ``j`` to its children as soon as it has arrived from its parent."""
    n = comm.size
    rel = (comm.me - root) % n
    parent, children = _tree_links(n, rel)
    (segments,) = _segments([buf])
    receives = [_irecv(comm, parent + root, seg) for seg in segments] if parent is not None else []
    sends = []
    for j, seg in enumerate(segments):
        if receives:
            _wait(receives[j])
        sends.extend(_isend(comm, child + root, seg) for child in children)
    for work in sends:
        _wait(work)


def _tree_reduce(comm: _Comm, acc: torch.Tensor, root: int, kind: _RedOpType) -> None:
    """Binomial-tree reduce into ``acc`` at group rank ``root``: ceil(log2 n) rounds.

    The mirror image of :func:`_tree_broadcast`: a rank combines its
    children's partial results (smallest subtree first) into ``acc`` and
    sends the sum to its parent; only the root's ``acc`` ends up holding the
    full reduction.  Pipelined by segments: segment ``j`` goes up as soon
    as every child's segment ``j`` is combined, while the next segments are
    still arriving (two receive slots per child).
    """
    n = comm.size
    rel = (comm.me - root) % n
    parent, children = _tree_links(n, rel)
    (segments,) = _segments([acc])
    slot = max(seg.numel() for seg in segments)
    depth = min(2, len(segments))
    scratch = {child: [acc.new_empty(slot) for _ in range(depth)] for child in children}

    def post(child: int, j: int):
        return _irecv(comm, child + root, scratch[child][j % depth][: segments[j].numel()])

    pending = {child: [post(child, j) for j in range(depth)] for child in children}
    sends = []
    for j, seg in enumerate(segments):
        for child in children:
            _wait(pending[child][j])
            _combine_(seg, scratch[child][j % depth][: seg.numel()], kind)
            if j + depth < len(segments):  # the slot is free again: receive two segments ahead
                pending[child].append(post(child, j + depth))
        if parent is not None:
            sends.append(_isend(comm, parent + root, seg))
    for work in sends:
        _wait(work)


def _ring_reduce_scatter(comm: _Comm, chunks: list[torch.Tensor], kind: _RedOpType) -> None:
    """Ring reduce-scatter over ``chunks`` in place (Patarasuk & Yuan 2009).

    n-1 steps; in step ``s`` rank ``i`` sends chunk ``(i-s-1) mod n`` to
    ``i+1`` and receives chunk ``(i-s-2) mod n`` from ``i-1``, combining it
    into its own copy.  Afterwards ``chunks[me]`` holds the reduction of
    everybody's ``chunks[me]`` (each element reduced exactly once along the
    ring); the other chunks hold partial results.  Each rank sends
    (n-1)/n of the data.

    Pipelined by segments (:data:`SEGMENT_BYTES`): the message of step
    ``s`` is the chunk reduced in step ``s-1``, so segment ``j`` may leave as
    soon as segment ``j`` of the previous step is reduced.  With ``k``
    segments per chunk, ``k`` receives are in flight, one scratch slot each.
    """
    n, me = comm.size, comm.me
    if n == 1:
        return
    segments = _segments(chunks)
    k = len(segments[0])
    slot = max(seg.numel() for chunk in segments for seg in chunk)
    # k small buffers, not one of k*slot: allocations under glibc's 32 MiB mmap ceiling come back
    # from the heap already mapped, one larger than it is mmapped and page-faulted on every call
    # (that alone cost the unsegmented ring 20% at n=2, 64 MiB here).
    scratch = [chunks[0].new_empty(slot) for _ in range(k)]
    in_flight: deque = deque()  # (receive, destination segment, scratch holding it), oldest first
    sends = []

    def reduce_oldest() -> None:
        work, target, incoming = in_flight.popleft()
        _wait(work)
        _combine_(target, incoming, kind)

    for message in range((n - 1) * k):
        step, j = divmod(message, k)
        if len(in_flight) == k:  # segment j of step-1: reduced before it is forwarded; frees slot j
            reduce_oldest()
        target = segments[(me - step - 2) % n][j]
        incoming = scratch[j][: target.numel()]
        in_flight.append((_irecv(comm, me - 1, incoming), target, incoming))
        sends.append(_isend(comm, me + 1, segments[(me - step - 1) % n][j]))
    while in_flight:
        reduce_oldest()
    for work in sends:  # a chunk sent in step s is never a reduction target later (s' = s-1 mod n)
        _wait(work)


def _ring_all_gather(comm: _Comm, chunks: list[torch.Tensor]) -> None:
    """Ring all-gather over ``chunks`` in place (Patarasuk & Yuan 2009).

    Rank ``i`` starts owning ``chunks[i]``.  n-1 steps; in step ``s`` rank
    ``i`` forwards chunk ``(i-s) mod n`` to ``i+1`` and receives chunk
    ``(i-s-1) mod n`` from ``i-1``.  Each rank sends (n-1)/n of the data.
    Pipelined by segments like :func:`_ring_reduce_scatter`: segment ``j`` is
    forwarded as soon as it has arrived.
    """
    n, me = comm.size, comm.me
    if n == 1:
        return
    segments = _segments(chunks)
    k = len(segments[0])
    receives: deque = deque()
    sends = []
    for message in range((n - 1) * k):
        step, j = divmod(message, k)
        if len(receives) == k:  # segment j of step-1 must have arrived before it is forwarded
            _wait(receives.popleft())
        receives.append(_irecv(comm, me - 1, segments[(me - step - 1) % n][j]))
        sends.append(_isend(comm, me + 1, segments[(me - step) % n][j]))
    for work in list(receives) + sends:
        _wait(work)


def _pairwise_exchange(comm: _Comm, send_chunks: list[torch.Tensor], recv_chunks: list[torch.Tensor]) -> None:
    """Pairwise all-to-all: own piece copied locally, then n-1 exchange steps.

    In step ``k`` rank ``r`` sends ``send_chunks[(r+k) mod n]`` to ``r+k``
    and receives ``recv_chunks[(r-k) mod n]`` from ``r-k``, with an
    isend/irecv pair so no ordering can deadlock.
    """
    n, me = comm.size, comm.me
    recv_chunks[me].copy_(send_chunks[me])
    for k in range(1, n):
        to, frm = (me + k) % n, (me - k) % n
        _exchange(comm, sends=[(to, send_chunks[to])], recvs=[(frm, recv_chunks[frm])])


# --------------------------------------------------------------------------
# Async handle
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# The collectives
# --------------------------------------------------------------------------


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """Copy ``tensor`` from the root to every rank, in place.

    Binomial tree rooted at the source: ceil(log2 n) rounds, each message the
    whole tensor of S bytes, so time ~ ceil(log2 n) * (alpha + beta * S) for
    per-message latency alpha and per-byte time beta.
    """
    _check_root_args("broadcast", "src", src, group_src)
    comm = _comm(group)
    if comm is None:
        return None
    root = _root(comm, "broadcast", "src", src, group_src)
    flat = _flat(tensor)
    _tree_broadcast(comm, flat, root)
    _store(tensor, flat)
    return _done(async_op, [tensor])


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    """Reduce ``tensor`` across the group into the destination's ``tensor``, in place.

    Binomial tree rooted at the destination: ceil(log2 n) rounds; every
    non-root rank sends S bytes exactly once.  Non-destination tensors are
    left unchanged (partial results live in a scratch copy).
    """
    _check_root_args("reduce", "dst", dst, group_dst)
    kind = _resolve_op("reduce", op, tensor.dtype)
    comm = _comm(group)
    if comm is None:
        return None
    root = _root(comm, "reduce", "dst", dst, group_dst)
    flat = _flat(tensor)
    is_root = comm.me == root
    acc = flat if is_root else flat.clone()
    _tree_reduce(comm, acc, root, kind)
    if is_root:
        _finish_avg_(acc, kind, comm.size)
        _store(tensor, flat)
    return _done(async_op, [tensor])


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``tensor`` across the group; every rank gets the result, in place.

    Ring reduce-scatter then ring all-gather on the flattened tensor split
    into n chunks (sizes differ by at most one): 2(n-1) steps, each rank sends
    2(n-1)/n * S bytes, which is bandwidth-optimal (Patarasuk & Yuan 2009).
    Each chunk is reduced once, at its owner, then copied, so every rank
    ends with bitwise identical results.
    """
    kind = _resolve_op("all_reduce", op, tensor.dtype)
    comm = _comm(group)
    if comm is None:
        return None
    flat = _flat(tensor)
    chunks = list(flat.split(_split_sizes(flat.numel(), comm.size)))
    _ring_reduce_scatter(comm, chunks, kind)
    _finish_avg_(chunks[comm.me], kind, comm.size)
    _ring_all_gather(comm, chunks)
    _store(tensor, flat)
    return _done(async_op, [tensor])


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    """Send ``scatter_list[i]`` from the root to group rank ``i``'s ``tensor``.

    Linear: the root posts n-1 sends at once (one per member) and copies
    its own piece; the root sends (n-1)/n of the list, each other rank
    receives S/n bytes in one round.
    """
    fn = "scatter"
    _check_root_args(fn, "src", src, group_src)
    comm = _comm(group)
    if comm is None:
        return None
    root = _root(comm, fn, "src", src, group_src)
    if comm.me == root:
        _check_list(fn, "scatter_list", scatter_list, comm.size)
        _check_list_entries(fn, "scatter_list", scatter_list, "tensor", tensor)
        sends = [(k, _flat(t)) for k, t in enumerate(scatter_list) if k != comm.me]
        _exchange(comm, sends=sends)
        tensor.copy_(scatter_list[comm.me].reshape(tensor.shape))
    else:
        if scatter_list:
            raise ValueError(f"{fn}: scatter_list must NOT be specified on non-source ranks")
        flat = _flat(tensor)
        _exchange(comm, recvs=[(root, flat)])
        _store(tensor, flat)
    return _done(async_op, [tensor])


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    """Collect every rank's ``tensor`` into ``gather_list`` at the root.

    Linear: every non-root sends its tensor straight to the root, which
    posts n-1 receives at once and copies its own piece; one round, the root
    receives (n-1)/n of the gathered data.
    """
    fn = "gather"
    _check_root_args(fn, "dst", dst, group_dst)
    comm = _comm(group)
    if comm is None:
        return None
    root = _root(comm, fn, "dst", dst, group_dst)
    if comm.me == root:
        _check_list(fn, "gather_list", gather_list, comm.size)
        _check_list_entries(fn, "gather_list", gather_list, "tensor", tensor)
        bufs = [_flat(t) for t in gather_list]
        _exchange(comm, recvs=[(k, b) for k, b in enumerate(bufs) if k != comm.me])
        for t, b in zip(gather_list, bufs):
            _store(t, b)
        gather_list[comm.me].copy_(tensor.reshape(gather_list[comm.me].shape))
    else:
        if gather_list:
            raise ValueError(f"{fn}: gather_list must NOT be specified on non-destination ranks")
        _exchange(comm, sends=[(root, _flat(tensor))])
    return _done(async_op, [tensor])


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """Every rank gets every rank's ``tensor``: ``tensor_list[i]`` from group rank ``i``.

    Ring all-gather with the list entries as the chunks: n-1 steps, each
    rank sends (n-1)/n * S bytes where S is the gathered size
    (Patarasuk & Yuan 2009).
    """
    fn = "all_gather"
    comm = _comm(group)
    if comm is None:
        return None
    _check_list(fn, "tensor_list", tensor_list, comm.size)
    _check_list_entries(fn, "tensor_list", tensor_list, "tensor", tensor)
    chunks = [_flat(t) for t in tensor_list]
    chunks[comm.me].copy_(tensor.reshape(-1))
    _ring_all_gather(comm, chunks)
    for t, c in zip(tensor_list, chunks):
        _store(t, c)
    return _done(async_op, tensor_list)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """All-gather into one tensor: group rank ``i``'s input fills the i-th n-th of the output.

    Ring all-gather over n equal chunks of the flattened output: n-1 steps,
    each rank sends (n-1)/n * S bytes, S = output size (Patarasuk & Yuan 2009).
    """
    fn = "all_gather_into_tensor"
    comm = _comm(group)
    if comm is None:
        return None
    n, m = comm.size, input_tensor.numel()
    _check_dtype(fn, "output_tensor", output_tensor, "input_tensor", input_tensor)
    _check_numel(fn, "output_tensor", output_tensor, n * m, f"group size {n} x input_tensor's {m} elements")
    out = _flat(output_tensor)
    chunks = list(out.split([m] * n))
    chunks[comm.me].copy_(input_tensor.reshape(-1))
    _ring_all_gather(comm, chunks)
    _store(output_tensor, out)
    return _done(async_op, [output_tensor])


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input_list[i]`` across the group into group rank ``i``'s ``output``.

    Ring reduce-scatter with the (packed) list entries as chunks: n-1 steps,
    each rank sends (n-1)/n * S bytes, S = total input size
    (Patarasuk & Yuan 2009).  Inputs are not modified.
    """
    fn = "reduce_scatter"
    kind = _resolve_op(fn, op, output.dtype)
    comm = _comm(group)
    if comm is None:
        return None
    _check_list(fn, "input_list", input_list, comm.size)
    _check_list_entries(fn, "input_list", input_list, "output", output)
    packed = torch.cat([t.reshape(-1) for t in input_list])
    chunks = list(packed.split([output.numel()] * comm.size))
    _ring_reduce_scatter(comm, chunks, kind)
    _finish_avg_(chunks[comm.me], kind, comm.size)
    output.copy_(chunks[comm.me].view(output.shape))
    return _done(async_op, [output])


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input`` across the group; group rank ``i`` gets the i-th n-th of the result.

    Ring reduce-scatter over n equal chunks of the flattened input: n-1
    steps, each rank sends (n-1)/n * S bytes, S = input size
    (Patarasuk & Yuan 2009).  ``input`` is not modified.
    """
    fn = "reduce_scatter_tensor"
    kind = _resolve_op(fn, op, input.dtype)
    comm = _comm(group)
    if comm is None:
        return None
    n, m = comm.size, output.numel()
    _check_dtype(fn, "output", output, "input", input)
    _check_numel(fn, "input", input, n * m, f"group size {n} x output's {m} elements")
    work = input.reshape(-1).clone()
    chunks = list(work.split([m] * n))
    _ring_reduce_scatter(comm, chunks, kind)
    _finish_avg_(chunks[comm.me], kind, n)
    output.copy_(chunks[comm.me].view(output.shape))
    return _done(async_op, [output])


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """Group rank ``r`` sends ``input_tensor_list[i]`` to rank ``i``, which stores it in its ``output_tensor_list[r]``.

    Pairwise exchange: own piece copied locally, then n-1 steps each with one
    isend/irecv pair; each rank sends (n-1)/n of its input.  Pieces may have
    different sizes per peer.
    """
    fn = "all_to_all"
    comm = _comm(group)
    if comm is None:
        return None
    n, me = comm.size, comm.me
    _check_list(fn, "output_tensor_list", output_tensor_list, n)
    _check_list(fn, "input_tensor_list", input_tensor_list, n)
    ref = input_tensor_list[0]
    _check_list_dtypes(fn, "input_tensor_list", input_tensor_list, "input_tensor_list[0]", ref)
    _check_list_dtypes(fn, "output_tensor_list", output_tensor_list, "input_tensor_list[0]", ref)
    if output_tensor_list[me].numel() != input_tensor_list[me].numel():
        raise ValueError(
            f"{fn}: output_tensor_list[{me}] has {output_tensor_list[me].numel()} elements but "
            f"input_tensor_list[{me}] (this rank's own piece) has {input_tensor_list[me].numel()}"
        )
    send_chunks = [_flat(t) for t in input_tensor_list]
    recv_chunks = [_flat(t) for t in output_tensor_list]
    _pairwise_exchange(comm, send_chunks, recv_chunks)
    for t, c in zip(output_tensor_list, recv_chunks):
        _store(t, c)
    return _done(async_op, output_tensor_list)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    """All-to-all on dim 0 of one tensor: input rows ``input_split_sizes[i]`` go to group rank ``i``.

    Pairwise exchange: own rows copied locally, then n-1 steps, in step k an
    isend to ``r+k`` and an irecv from ``r-k``; each rank sends the part of
    its input not addressed to itself ((n-1)/n of it for equal splits).
    Split sizes may be unequal and zero; ``None`` means equal pieces.
    """
    fn = "all_to_all_single"
    comm = _comm(group)
    if comm is None:
        return None
    n, me = comm.size, comm.me
    _check_dtype(fn, "output", output, "input", input)
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError(f"{fn}: input and output must have at least one dimension")
    in_row, out_row = input.shape[1:].numel(), output.shape[1:].numel()
    if in_row != out_row:
        raise ValueError(
            f"{fn}: input rows have {in_row} elements (shape {tuple(input.shape)}) but output rows "
            f"have {out_row} (shape {tuple(output.shape)})"
        )
    in_splits = _row_splits(fn, "input", input, input_split_sizes, n)
    out_splits = _row_splits(fn, "output", output, output_split_sizes, n)
    if in_splits[me] != out_splits[me]:
        raise ValueError(
            f"{fn}: this rank sends itself {in_splits[me]} rows (input_split_sizes[{me}]) "
            f"but expects {out_splits[me]} (output_split_sizes[{me}])"
        )
    send_chunks = list(_flat(input).split([s * in_row for s in in_splits]))
    out = _flat(output)
    recv_chunks = list(out.split([s * out_row for s in out_splits]))
    _pairwise_exchange(comm, send_chunks, recv_chunks)
    _store(output, out)
    return _done(async_op, [output])
