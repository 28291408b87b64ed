"""Bug: interleaved warm-up clamped at m (1F1B's clamp) instead of v*m
verdict: fail
capability: pipeline_schedules

The engineer copied the clamp of the 1F1B warm-up, min(p - 1 - r, m), into the interleaved
generator: warm = min((v-1)p + 2(p-1-r), m) instead of min(..., v*m). Whenever the Megatron warm-up
exceeds m (few microbatches: m = p, or m = 2p with v = 2 and p >= 3) ranks start their 1F1B steady
state too early and wait for gradients that cannot have come back yet. Up to p = 5 (its author's
own simulator) the schedule stays valid and deadlock-free, the loss and gradients are exact, but the
bubble is larger than (p-1)/(vm+p-1) and the activation peaks are not the contract's; at larger p*v
(p = 8, v = 3, found by the suite) it schedules a backward before its forward. On p = 2, v = 2,
m = 4 the clamp is inactive and the schedule is exactly right.
"""
import re

import torch
import torch.distributed as dist


# ------------------------------------------------------------------------------ schedule generation
def _stage_of(rank, chunk, p):
    return rank + chunk * p


def _compute_order_gpipe(p, m, r):
    return [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]


def _compute_order_1f1b(p, m, r):
    warm = min(p - 1 - r, m)
    order = [("F", r, i) for i in range(warm)]
    fwd, bwd = warm, 0
    while fwd < m:
        order.append(("F", r, fwd))
        fwd += 1
        order.append(("B", r, bwd))
        bwd += 1
    while bwd < m:
        order.append(("B", r, bwd))
        bwd += 1
    return order


def _compute_order_interleaved(p, m, v, r):
    total = v * m
    group = p * v

    def fwd(k):
        chunk = (k % group) // p
        mb = (k // group) * p + k % p
        return ("F", _stage_of(r, chunk, p), mb)

    def bwd(k):
        chunk = v - 1 - (k % group) // p
        mb = (k // group) * p + k % p
        return ("B", _stage_of(r, chunk, p), mb)

    warm = min((v - 1) * p + 2 * (p - 1 - r), m)
    order = [fwd(k) for k in range(warm)]
    f, b = warm, 0
    while f < total:
        order.append(fwd(f))
        f += 1
        order.append(bwd(b))
        b += 1
    while b < total:
        order.append(bwd(b))
        b += 1
    return order


def _lower(order, p, S):
    """Insert receives right before and sends right after the compute that needs / produces them."""
    row = []
    for kind, s, i in order:
        if kind == "F":
            if s > 0 and p > 1:
                row.append(f"{s}RECV_F{i}")
            row.append(f"{s}F{i}")
            if s < S - 1 and p > 1:
                row.append(f"{s}SEND_F{i}")
        else:
            if s < S - 1 and p > 1:
                row.append(f"{s}RECV_B{i}")
            row.append(f"{s}B{i}")
            if s > 0 and p > 1:
                row.append(f"{s}SEND_B{i}")
    return row


def generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank=1):
    p, m, v = int(num_ranks), int(num_microbatches), int(stages_per_rank)
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need num_ranks, num_microbatches, stages_per_rank >= 1, got {p}, {m}, {v}")
    if kind in ("gpipe", "1f1b"):
        if v != 1:
            raise ValueError(f"{kind!r} takes stages_per_rank=1, got {v}")
        make = _compute_order_gpipe if kind == "gpipe" else _compute_order_1f1b
        return [_lower(make(p, m, r), p, p) for r in range(p)]
    if kind == "interleaved":
        if m % p != 0:
            raise ValueError(f"interleaved: num_microbatches ({m}) must be a multiple of num_ranks ({p})")
        if v == 1:
            return [_lower(_compute_order_1f1b(p, m, r), p, p) for r in range(p)]
        return [_lower(_compute_order_interleaved(p, m, v, r), p, p * v) for r in range(p)]
    if kind in ("zb-h1", "zb-v"):
        raise NotImplementedError(f"generate_schedule: {kind!r} is not implemented")
    raise ValueError(f"unknown schedule kind {kind!r}")


# ----------------------------------------------------------------------------------- the runtime
_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)$")

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_MAX_NDIM = 8
_HEADER_LEN = 2 + _MAX_NDIM

_HDR, _ACT, _GRAD = 0, 1, 2


def _parse(action):
    mt = _ACTION.match(action.strip())
    if mt is None:
        raise ValueError(f"pipeline_step: cannot parse action {action!r}")
    return int(mt.group(1)), mt.group(2), int(mt.group(3))


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None,
                  placement=None, trace=None):
    if placement is not None:
        raise NotImplementedError("pipeline_step: placement is not implemented")
    chunks = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    v = len(chunks)
    m = int(num_microbatches)
    p = dist.get_world_size(group)
    r = dist.get_rank(group)
    S = p * v

    if callable(schedule):
        rows = schedule(p, m, v)
    else:
        rows = generate_schedule(schedule, p, m, v)
    row = list(rows[r])

    def global_rank(group_rank):
        return dist.get_global_rank(group, group_rank) if group is not None else group_rank

    def local(s):
        return chunks[(s - r) // p]

    def tag(boundary, mb, direction):
        return ((mb * S) + boundary) * 3 + direction

    device = torch.device("cpu")
    for c in chunks:
        for prm in c.parameters():
            device = prm.device
            break

    x_mbs = list(torch.tensor_split(inputs, m, dim=0)) if r == 0 and inputs is not None else None
    y_mbs = list(torch.tensor_split(targets, m, dim=0)) if r == (S - 1) % p and targets is not None else None

    stage_in = {}    # (s, i) -> input tensor (leaf requiring grad for s > 0)
    stage_out = {}   # (s, i) -> output tensor (loss for the last stage)
    recv_grad = {}   # (s, i) -> gradient of the output of s
    losses = {}
    pending = []
    keep = []

    for action in row:
        s, kind, i = _parse(action)
        if kind == "RECV_F":
            src = global_rank((s - 1) % p)
            hdr = torch.zeros(_HEADER_LEN, dtype=torch.int64)
            dist.recv(hdr, src=src, group=group, tag=tag(s - 1, i, _HDR))
            dtype = _DTYPES[int(hdr[0])]
            shape = [int(d) for d in hdr[2:2 + int(hdr[1])]]
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, src=src, group=group, tag=tag(s - 1, i, _ACT))
            if buf.is_floating_point() or buf.is_complex():
                buf.requires_grad_(True)
            stage_in[(s, i)] = buf
        elif kind == "F":
            if s == 0:
                x = x_mbs[i]
            elif (s, i) in stage_in:
                x = stage_in[(s, i)]
            else:  # local transfer from stage s - 1 on this rank
                prev = stage_out[(s - 1, i)]
                x = prev.detach().requires_grad_(prev.requires_grad)
                stage_in[(s, i)] = x
            if s == 0:
                stage_in[(s, i)] = x
            out = local(s)(x)
            if s == S - 1:
                loss = loss_fn(out, y_mbs[i])
                losses[i] = loss.detach()
                stage_out[(s, i)] = loss
            else:
                stage_out[(s, i)] = out
        elif kind == "SEND_F":
            out = stage_out[(s, i)].detach().contiguous()
            dst = global_rank((s + 1) % p)
            hdr = torch.zeros(_HEADER_LEN, dtype=torch.int64)
            hdr[0] = _DTYPES.index(out.dtype)
            hdr[1] = out.dim()
            for d, n in enumerate(out.shape):
                hdr[2 + d] = n
            keep.extend([hdr, out])
            pending.append(dist.isend(hdr, dst=dst, group=group, tag=tag(s, i, _HDR)))
            pending.append(dist.isend(out, dst=dst, group=group, tag=tag(s, i, _ACT)))
        elif kind == "RECV_B":
            out = stage_out[(s, i)]
            buf = torch.empty(out.shape, dtype=out.dtype, device=out.device)
            dist.recv(buf, src=global_rank((s + 1) % p), group=group, tag=tag(s, i, _GRAD))
            recv_grad[(s, i)] = buf
        elif kind == "B":
            out = stage_out.pop((s, i))
            if s == S - 1:
                torch.autograd.backward(out / m)
            else:
                if (s, i) in recv_grad:
                    g = recv_grad.pop((s, i))
                else:  # local transfer: the gradient is the input gradient of stage s + 1
                    nxt = stage_in.pop((s + 1, i))
                    g = nxt.grad if nxt.grad is not None else torch.zeros_like(nxt)
                if out.requires_grad:
                    torch.autograd.backward(out, g)
            if s == 0:
                stage_in.pop((s, i), None)
        elif kind == "SEND_B":
            x = stage_in.pop((s, i))
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            g = g.contiguous()
            keep.append(g)
            pending.append(dist.isend(g, dst=global_rank((s - 1) % p), group=group, tag=tag(s - 1, i, _GRAD)))
        else:  # pragma: no cover
            raise ValueError(f"pipeline_step: unsupported action {action!r}")

    for w in pending:
        w.wait()

    if r == (S - 1) % p:
        total = None
        for i in range(m):
            total = losses[i] if total is None else total + losses[i]
        return (total / m).detach()
    return None
