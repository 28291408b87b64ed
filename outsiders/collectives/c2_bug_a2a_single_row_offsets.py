"""all_to_all_single slices its pieces at row offsets used as element offsets: right only for 1-D tensors
verdict: fail
capability: all_to_all_single

The student converts split sizes (counted in rows of dim 0) to element ranges of the flattened
tensor, multiplying the piece length by the row size but not the running offset, which stays a row
count. For 1-D tensors the row size is 1 and everything is right, whatever the splits; for tensors
with more than one dimension the pieces sent overlap the start of the input and the received
pieces are written over each other near the start of the output, so the tail of the output is
never written and the rest holds the wrong rows. No size ever disagrees, so nothing hangs.
"""
import math

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp


# ----------------------------------------------------------------------------------- helpers
class _CompletedWork:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def synchronize(self):
        pass


def _ret(async_op):
    return _CompletedWork() if async_op else None


def _members(group):
    """(global ranks in group-rank order, my index, group object to pass to p2p)."""
    if group is None or group is dist.GroupMember.WORLD:
        members = list(range(dist.get_world_size()))
        group = None
    else:
        members = [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]
    return members, members.index(dist.get_rank()), group


def _exchange(send_t, dst, recv_t, src, group):
    """Send send_t to global rank dst while receiving recv_t from global rank src."""
    reqs = []
    if send_t is not None and send_t.numel() > 0:
        reqs.append(dist.isend(send_t, dst=dst, group=group))
    if recv_t is not None and recv_t.numel() > 0:
        reqs.append(dist.irecv(recv_t, src=src, group=group))
    for r in reqs:
        r.wait()


def _combine(acc, inc, op):
    """acc <- op(acc, inc), in place."""
    if op == ReduceOp.SUM or op == ReduceOp.AVG:
        acc.add_(inc)
    elif op == ReduceOp.PRODUCT:
        acc.mul_(inc)
    elif op == ReduceOp.MIN:
        torch.minimum(acc, inc, out=acc)
    elif op == ReduceOp.MAX:
        torch.maximum(acc, inc, out=acc)
    elif op == ReduceOp.BAND:
        acc.bitwise_and_(inc)
    elif op == ReduceOp.BOR:
        acc.bitwise_or_(inc)
    elif op == ReduceOp.BXOR:
        acc.bitwise_xor_(inc)
    else:
        raise ValueError(f"unsupported reduce op {op}")


def _finalize(t, op, n):
    """Apply AVG's division once, to a finished reduction."""
    if op == ReduceOp.AVG:
        if t.dtype.is_floating_point:
            t.div_(n)
        else:
            t.copy_(torch.div(t, n, rounding_mode="trunc"))


def _ring_reduce_scatter(chunks, op, members, me, group):
    """chunks: n working tensors (modified). Afterwards chunks[me] holds op over all members."""
    n = len(members)
    right, left = members[(me + 1) % n], members[(me - 1) % n]
    for s in range(n - 1):
        send_idx = (me - s - 1) % n
        recv_idx = (me - s - 2) % n
        buf = torch.empty_like(chunks[recv_idx])
        _exchange(chunks[send_idx], right, buf, left, group)
        if buf.numel() > 0:
            _combine(chunks[recv_idx], buf, op)


def _ring_all_gather(chunks, members, me, group):
    """chunks: n output tensors, chunks[me] already filled. Afterwards all are filled."""
    n = len(members)
    right, left = members[(me + 1) % n], members[(me - 1) % n]
    for s in range(n - 1):
        send_idx = (me - s) % n
        recv_idx = (me - s - 1) % n
        _exchange(chunks[send_idx], right, chunks[recv_idx], left, group)


def _equal_chunks(flat, n, size):
    return [flat[i * size:(i + 1) * size] for i in range(n)]


def _root_index(members, src, group_src, name):
    if group_src is not None:
        return group_src
    if src is None:
        raise ValueError(f"{name}: a root rank is required")
    return members.index(src)


# ----------------------------------------------------------------------------------- collectives
def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    members, me, pg = _members(group)
    n = len(members)
    root = _root_index(members, src, group_src, "broadcast")
    rel = (me - root) % n
    mask = 1
    while mask < n:
        if rel < mask:
            peer = rel + mask
            if peer < n and tensor.numel() > 0:
                dist.send(tensor, dst=members[(peer + root) % n], group=pg)
        elif rel < 2 * mask:
            if tensor.numel() > 0:
                dist.recv(tensor, src=members[(rel - mask + root) % n], group=pg)
        mask <<= 1
    return _ret(async_op)


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    members, me, pg = _members(group)
    n = len(members)
    root = _root_index(members, dst, group_dst, "reduce")
    flat = tensor.view(-1)
    chunks = list(torch.tensor_split(flat, n))
    _ring_reduce_scatter(chunks, op, members, me, pg)
    _finalize(chunks[me], op, n)
    # gather the finished chunks to the root
    if me == root:
        reqs = [dist.irecv(chunks[i], src=members[i], group=pg)
                for i in range(n) if i != root and chunks[i].numel() > 0]
        for r in reqs:
            r.wait()
    elif chunks[me].numel() > 0:
        dist.send(chunks[me], dst=members[root], group=pg)
    return _ret(async_op)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    members, me, pg = _members(group)
    n = len(members)
    flat = tensor.view(-1)
    chunks = list(torch.tensor_split(flat, n))
    _ring_reduce_scatter(chunks, op, members, me, pg)
    _finalize(chunks[me], op, n)
    _ring_all_gather(chunks, members, me, pg)
    return _ret(async_op)


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    members, me, pg = _members(group)
    n = len(members)
    root = _root_index(members, src, group_src, "scatter")
    if me == root:
        reqs = [dist.isend(scatter_list[i], dst=members[i], group=pg)
                for i in range(n) if i != root and scatter_list[i].numel() > 0]
        tensor.copy_(scatter_list[root])
        for r in reqs:
            r.wait()
    elif tensor.numel() > 0:
        dist.recv(tensor, src=members[root], group=pg)
    return _ret(async_op)


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    members, me, pg = _members(group)
    n = len(members)
    root = _root_index(members, dst, group_dst, "gather")
    if me == root:
        reqs = [dist.irecv(gather_list[i], src=members[i], group=pg)
                for i in range(n) if i != root and gather_list[i].numel() > 0]
        gather_list[root].copy_(tensor)
        for r in reqs:
            r.wait()
    elif tensor.numel() > 0:
        dist.send(tensor, dst=members[root], group=pg)
    return _ret(async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    members, me, pg = _members(group)
    chunks = list(tensor_list)
    chunks[me].copy_(tensor)
    _ring_all_gather(chunks, members, me, pg)
    return _ret(async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    members, me, pg = _members(group)
    n = len(members)
    k = input_tensor.numel()
    chunks = _equal_chunks(output_tensor.view(-1), n, k)
    chunks[me].copy_(input_tensor.reshape(-1))
    _ring_all_gather(chunks, members, me, pg)
    return _ret(async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    members, me, pg = _members(group)
    n = len(members)
    chunks = [t.clone() for t in input_list]
    _ring_reduce_scatter(chunks, op, members, me, pg)
    _finalize(chunks[me], op, n)
    output.copy_(chunks[me].view_as(output))
    return _ret(async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    members, me, pg = _members(group)
    n = len(members)
    k = output.numel()
    work = input.clone().view(-1)
    chunks = _equal_chunks(work, n, k)
    _ring_reduce_scatter(chunks, op, members, me, pg)
    _finalize(chunks[me], op, n)
    output.view(-1).copy_(chunks[me])
    return _ret(async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    members, me, pg = _members(group)
    n = len(members)
    inputs = [t.clone() if any(t.data_ptr() == o.data_ptr() and t.numel() > 0 for o in output_tensor_list) else t
              for t in input_tensor_list]
    output_tensor_list[me].copy_(inputs[me])
    for s in range(1, n):
        to, frm = (me + s) % n, (me - s) % n
        _exchange(inputs[to], members[to], output_tensor_list[frm], members[frm], pg)
    return _ret(async_op)


def _split_views(t, splits, n):
    rows = t.size(0) if t.dim() > 0 else 0
    if splits is None:
        splits = [rows // n] * n
    splits = [int(s) for s in splits]
    inner = math.prod(t.shape[1:]) if t.dim() > 0 else 1
    flat = t.view(-1)
    views, off = [], 0
    for s in splits:
        views.append(flat[off:off + s * inner])
        off += s
    return views


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    members, me, pg = _members(group)
    n = len(members)
    if input.numel() > 0 and output.numel() > 0 and input.data_ptr() == output.data_ptr():
        input = input.clone()
    ins = _split_views(input, input_split_sizes, n)
    outs = _split_views(output, output_split_sizes, n)
    outs[me].copy_(ins[me])
    for s in range(1, n):
        to, frm = (me + s) % n, (me - s) % n
        _exchange(ins[to], members[to], outs[frm], members[frm], pg)
    return _ret(async_op)
