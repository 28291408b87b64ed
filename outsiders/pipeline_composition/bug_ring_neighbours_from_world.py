"""all_reduce takes its ring neighbours as (global rank +/- 1) mod world size instead of the neighbours inside the group, so a data-parallel group that is not the whole world sends to and receives from non-members.
verdict: fail
capability: pipeline_composition

A ring all-reduce written first for the world and later given a group= argument: the group is
passed to isend/recv and its size sets the chunk count, but the neighbours are still derived from
dist.get_rank() and dist.get_world_size(). Every test on the world group passes, as does the
pipeline itself (which does not use all_reduce); on a pp x dp mesh the stage groups
{s*dp, ..., s*dp + dp - 1} have members whose ring neighbour is in the next or previous stage's
group, which is not a member, and the gradient sync fails.
"""
import re

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = ["pipeline_step", "all_reduce"]


# ------------------------------------------------------------------------------------ helpers
def _members(group):
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


class _Done:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _combine(a, b, op):
    if op == ReduceOp.SUM or op == ReduceOp.AVG:
        return a + b
    if op == ReduceOp.PRODUCT:
        return a * b
    if op == ReduceOp.MIN:
        return torch.minimum(a, b)
    if op == ReduceOp.MAX:
        return torch.maximum(a, b)
    if op == ReduceOp.BAND:
        return a & b
    if op == ReduceOp.BOR:
        return a | b
    if op == ReduceOp.BXOR:
        return a ^ b
    raise ValueError(f"unsupported reduce op {op}")


# --------------------------------------------------------------------------------- all_reduce
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Ring all-reduce (reduce-scatter, then all-gather) over the members of ``group``."""
    n = dist.get_world_size(group)
    if n > 1:
        r = dist.get_rank(group)
        right = (dist.get_rank() + 1) % dist.get_world_size()
        left = (dist.get_rank() - 1) % dist.get_world_size()
        flat = tensor.detach().reshape(-1).clone()
        chunks = list(torch.tensor_split(flat, n))

        def exchange(send_chunk, recv_buf, tag):
            work = None
            if send_chunk.numel() > 0:
                work = dist.isend(send_chunk.clone(), dst=right, group=group, tag=tag)
            if recv_buf.numel() > 0:
                dist.recv(recv_buf, src=left, group=group, tag=tag)
            if work is not None:
                work.wait()

        for k in range(n - 1):
            send_idx = (r - k) % n
            recv_idx = (r - k - 1) % n
            incoming = torch.empty_like(chunks[recv_idx])
            exchange(chunks[send_idx], incoming, k)
            if incoming.numel() > 0:
                chunks[recv_idx].copy_(_combine(chunks[recv_idx], incoming, op))
        for k in range(n - 1):
            send_idx = (r + 1 - k) % n
            recv_idx = (r - k) % n
            incoming = torch.empty_like(chunks[recv_idx])
            exchange(chunks[send_idx], incoming, n - 1 + k)
            chunks[recv_idx].copy_(incoming)
        tensor.copy_(flat.view_as(tensor))
    if op == ReduceOp.AVG:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(n)
        else:
            tensor.copy_(torch.div(tensor, n, rounding_mode="trunc"))
    return _Done() if async_op else None


# ---------------------------------------------------------------------------------- schedules
def _forward_actions(r, p, i):
    acts = []
    if r > 0:
        acts.append(f"{r}RECV_F{i}")
    acts.append(f"{r}F{i}")
    if r < p - 1:
        acts.append(f"{r}SEND_F{i}")
    return acts


def _backward_actions(r, p, i):
    acts = []
    if r < p - 1:
        acts.append(f"{r}RECV_B{i}")
    acts.append(f"{r}B{i}")
    if r > 0:
        acts.append(f"{r}SEND_B{i}")
    return acts


def _gpipe_row(r, p, m):
    row = []
    for i in range(m):
        row += _forward_actions(r, p, i)
    for i in range(m):
        row += _backward_actions(r, p, i)
    return row


def _one_f_one_b_row(r, p, m):
    warmup = min(p - 1 - r, m)
    row = []
    for i in range(warmup):
        row += _forward_actions(r, p, i)
    for k in range(m - warmup):
        row += _forward_actions(r, p, warmup + k)
        row += _backward_actions(r, p, k)
    for i in range(m - warmup, m):
        row += _backward_actions(r, p, i)
    return row


_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
           torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool, torch.int16]
_MAX_DIMS = 8


def _tag(boundary, microbatch, direction, part, num_stages):
    return ((microbatch * num_stages + boundary) * 2 + direction) * 2 + part


# ------------------------------------------------------------------------------ pipeline_step
def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None):
    """One training step of the pipeline over ``group``; the last stage's rank returns the mean loss."""
    chunks = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    v = len(chunks)
    p = dist.get_world_size(group)
    me = dist.get_rank(group)
    members = _members(group)
    m = int(num_microbatches)
    if m < 1:
        raise ValueError("num_microbatches must be at least 1")
    num_stages = p * v

    if callable(schedule):
        rows = schedule(p, m, v)
    elif schedule in ("gpipe", "1f1b"):
        if v != 1:
            raise ValueError(f"schedule {schedule!r} takes one stage per rank, got {v}")
        make = _gpipe_row if schedule == "gpipe" else _one_f_one_b_row
        rows = [make(r, p, m) for r in range(p)]
    else:
        raise NotImplementedError(f"schedule {schedule!r} is not implemented")
    row = rows[me]

    def rank_of(stage):
        return stage % p

    def module_of(stage):
        return chunks[stage // p]

    micro_x = list(torch.tensor_split(inputs, m)) if me == 0 else None
    micro_y = list(torch.tensor_split(targets, m)) if me == p - 1 else None

    stage_in = {}
    stage_out = {}
    received_in = {}
    received_grad = {}
    local_grad = {}
    grad_to_send = {}
    pending = []
    loss_total = None

    for action in row:
        match = _ACTION.match(action)
        if match is None:
            raise ValueError(f"cannot parse action {action!r}")
        s, kind, i = int(match.group(1)), match.group(2), int(match.group(3))
        if kind in ("I", "W"):
            raise NotImplementedError("split backward (I/W) is not implemented")

        if kind == "F":
            if s == 0:
                x = micro_x[i]
            elif rank_of(s - 1) == me:
                prev = stage_out[(s - 1, i)]
                x = prev.detach()
                if x.is_floating_point():
                    x.requires_grad_(True)
            else:
                x = received_in.pop((s, i))
            out = module_of(s)(x)
            if s == num_stages - 1:
                out = loss_fn(out, micro_y[i])
                loss_total = out.detach() if loss_total is None else loss_total + out.detach()
            stage_in[(s, i)] = x
            stage_out[(s, i)] = out

        elif kind == "B":
            out = stage_out.pop((s, i))
            x = stage_in.pop((s, i))
            if s == num_stages - 1:
                (out / m).backward()
            else:
                if rank_of(s + 1) == me:
                    g = local_grad.pop((s, i))
                else:
                    g = received_grad.pop((s, i))
                if out.requires_grad:
                    torch.autograd.backward(out, g)
            if s > 0:
                gx = x.grad if x.grad is not None else torch.zeros_like(x)
                if rank_of(s - 1) == me:
                    local_grad[(s - 1, i)] = gx
                else:
                    grad_to_send[(s, i)] = gx

        elif kind == "SEND_F":
            out = stage_out[(s, i)].detach().contiguous()
            if out.dim() > _MAX_DIMS:
                raise ValueError("activations with more than 8 dims are not supported")
            header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
            header[0] = _DTYPES.index(out.dtype)
            header[1] = out.dim()
            header[2:2 + out.dim()] = torch.tensor(out.shape, dtype=torch.int64)
            peer = members[rank_of(s + 1)]
            pending.append((dist.isend(header, dst=peer, group=group,
                                       tag=_tag(s, i, 0, 0, num_stages)), header))
            pending.append((dist.isend(out, dst=peer, group=group,
                                       tag=_tag(s, i, 0, 1, num_stages)), out))

        elif kind == "RECV_F":
            peer = members[rank_of(s - 1)]
            header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
            dist.recv(header, src=peer, group=group, tag=_tag(s - 1, i, 0, 0, num_stages))
            dtype = _DTYPES[int(header[0])]
            shape = [int(d) for d in header[2:2 + int(header[1])]]
            buf = torch.empty(shape, dtype=dtype)
            dist.recv(buf, src=peer, group=group, tag=_tag(s - 1, i, 0, 1, num_stages))
            if buf.is_floating_point():
                buf.requires_grad_(True)
            received_in[(s, i)] = buf

        elif kind == "SEND_B":
            gx = grad_to_send.pop((s, i)).detach().contiguous()
            peer = members[rank_of(s - 1)]
            pending.append((dist.isend(gx, dst=peer, group=group,
                                       tag=_tag(s - 1, i, 1, 1, num_stages)), gx))

        elif kind == "RECV_B":
            out = stage_out[(s, i)]
            buf = torch.empty(out.shape, dtype=out.dtype)
            peer = members[rank_of(s + 1)]
            dist.recv(buf, src=peer, group=group, tag=_tag(s, i, 1, 1, num_stages))
            received_grad[(s, i)] = buf

    for work, _ in pending:
        work.wait()

    if me == p - 1:
        return (loss_total / m).detach()
    return None
