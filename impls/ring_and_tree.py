"""How the collectives of impls/collectives.py move bytes: point-to-point sends and receives
(messages over SEGMENT_BYTES cut into pipelined segments), reductions in the tensor's own dtype,
binomial trees (broadcast, reduce), rings (reduce-scatter, all-gather) and the pairwise exchange
(all-to-all). The costs of each are in impls/collectives.py's docstring."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .collective_args import _Comm, _split_sizes

_RedOpType = ReduceOp.RedOpType


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


# Reduction operators

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
