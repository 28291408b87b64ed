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

import torch
from torch.distributed import ReduceOp

from .collective_args import (
    _check_dtype,
    _check_list,
    _check_list_dtypes,
    _check_list_entries,
    _check_numel,
    _check_root_args,
    _comm,
    _done,
    _flat,
    _root,
    _row_splits,
    _split_sizes,
    _store,
)
from .ring_and_tree import (
    _exchange,
    _finish_avg_,
    _pairwise_exchange,
    _resolve_op,
    _ring_all_gather,
    _ring_reduce_scatter,
    _tree_broadcast,
    _tree_reduce,
)

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
            f"{fn}: input rows have {in_row} elements (shape {tuple(input.shape)}) but output rows have {out_row} (shape {tuple(output.shape)})"
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
