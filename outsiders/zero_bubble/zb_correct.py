"""Correct: a table-driven executor that splits backward into autograd.grad on the stage input (graph kept) and autograd.backward into the weights.

verdict: pass
capability: zero_bubble

Every schedule, named or callable, is lowered to one list of compact actions per rank and run in
order.  F keeps the stage input (a fresh leaf) and the stage output; B is one autograd.backward
into the weights and the input; I is torch.autograd.grad on the input with retain_graph=True, so
that the later W can run autograd.backward(inputs=weights) over the same graph and free it.
Sends are isend (waited at the end), receives block; messages carry a tag made of
(boundary, microbatch, direction), and every activation is preceded by a small shape header.
"""
import re

import torch
import torch.distributed as dist

_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_HDR = 16


# ------------------------------------------------------------------------------ schedule generation
def _lower(p, S, stage, kind, i):
    """Compute action with its receive right before and its send right after."""
    out = []
    if kind == "F":
        if p > 1 and stage > 0:
            out.append(f"{stage}RECV_F{i}")
        out.append(f"{stage}F{i}")
        if p > 1 and stage < S - 1:
            out.append(f"{stage}SEND_F{i}")
    elif kind in ("B", "I"):
        if p > 1 and stage < S - 1:
            out.append(f"{stage}RECV_B{i}")
        out.append(f"{stage}{kind}{i}")
        if p > 1 and stage > 0:
            out.append(f"{stage}SEND_B{i}")
    else:
        out.append(f"{stage}{kind}{i}")
    return out


def _rows_from_orders(p, S, orders):
    return [[a for (stage, kind, i) in order for a in _lower(p, S, stage, kind, i)] for order in orders]


def _gpipe(p, m):
    return [[(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)]


def _one_f_one_b(p, m):
    orders = []
    for r in range(p):
        w = min(p - 1 - r, m)
        order = [(r, "F", i) for i in range(w)]
        for k in range(m - w):
            order.append((r, "F", w + k))
            order.append((r, "B", k))
        order += [(r, "B", k) for k in range(m - w, m)]
        orders.append(order)
    return orders


def _interleaved(p, m, v):
    if m % p != 0:
        raise ValueError(f"interleaved: num_microbatches ({m}) must be a multiple of num_ranks ({p})")
    total = v * m

    def mb(k):
        return (k // (p * v)) * p + k % p

    def fchunk(k):
        return (k % (p * v)) // p

    orders = []
    for r in range(p):
        w = min((v - 1) * p + 2 * (p - 1 - r), total)
        order = [(fchunk(k) * p + r, "F", mb(k)) for k in range(w)]
        for k in range(total - w):
            kf = w + k
            order.append((fchunk(kf) * p + r, "F", mb(kf)))
            order.append(((v - 1 - fchunk(k)) * p + r, "B", mb(k)))
        for k in range(total - w, total):
            order.append(((v - 1 - fchunk(k)) * p + r, "B", mb(k)))
        orders.append(order)
    return orders


def _zb_h1(p, m):
    orders = []
    for r in range(p):
        w = min(p - 1 - r, m)
        order = [(r, "F", i) for i in range(w)]
        deferred = []
        k = 0
        while w + k < m:
            order.append((r, "F", w + k))
            order.append((r, "I", k))
            deferred.append(k)
            if k >= r:
                order.append((r, "W", deferred.pop(0)))
            k += 1
        while k < m:
            order.append((r, "I", k))
            deferred.append(k)
            order.append((r, "W", deferred.pop(0)))
            k += 1
        order += [(r, "W", j) for j in deferred]
        orders.append(order)
    return orders


def generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank=1):
    p, m, v = int(num_ranks), int(num_microbatches), int(stages_per_rank)
    if p < 1 or m < 1 or v < 1:
        raise ValueError("num_ranks, num_microbatches and stages_per_rank must be >= 1")
    kind = str(kind).lower()
    if kind == "gpipe":
        if v != 1:
            raise ValueError("gpipe takes stages_per_rank=1")
        orders = _gpipe(p, m)
    elif kind == "1f1b":
        if v != 1:
            raise ValueError("1f1b takes stages_per_rank=1")
        orders = _one_f_one_b(p, m)
    elif kind == "interleaved":
        orders = _one_f_one_b(p, m) if v == 1 else _interleaved(p, m, v)
    elif kind == "zb-h1":
        if v != 1:
            raise ValueError("zb-h1 takes stages_per_rank=1")
        orders = _zb_h1(p, m)
    else:
        raise ValueError(f"unknown schedule kind {kind!r}")
    return _rows_from_orders(p, p * v, orders)


# ----------------------------------------------------------------------------------------- runtime
def _tag(boundary, i, m, backward, header):
    return (((boundary * m) + i) * 2 + int(backward)) * 2 + int(header)


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None):
    if isinstance(stages, torch.nn.Module) and not isinstance(stages, torch.nn.ModuleList):
        mods = [stages]
    else:
        mods = list(stages)
    v = len(mods)
    m = int(num_microbatches)
    p = dist.get_world_size(group)
    me = dist.get_rank(group)
    S = p * v

    rows = schedule(p, m, v) if callable(schedule) else generate_schedule(schedule, p, m, v)
    row = list(rows[me])

    device = torch.device("cpu")
    for mod in mods:
        for q in mod.parameters():
            device = q.device
            break

    def global_rank(stage):
        gr = stage % p
        return gr if group is None else dist.get_global_rank(group, gr)

    xs = torch.tensor_split(inputs, m, dim=0) if inputs is not None and me == 0 else None
    ys = torch.tensor_split(targets, m, dim=0) if targets is not None and me == (S - 1) % p else None

    def params_of(stage):
        return [q for q in mods[stage // p].parameters() if q.requires_grad]

    fwd_buf, bwd_buf = {}, {}        # inputs waiting for F, output gradients waiting for B/I
    send_f, send_b = {}, {}          # tensors waiting for their SEND
    inp, out, meta, wgrad = {}, {}, {}, {}
    losses = {}
    pending = []

    def input_grad_done(s, i, gx):
        x = inp[(s, i)]
        if gx is None:
            gx = torch.zeros_like(x)
        gx = gx.detach()
        if p == 1:
            bwd_buf[(s - 1, i)] = gx
        else:
            send_b[(s, i)] = gx.contiguous()

    for action in row:
        mt = _ACTION.match(action)
        if mt is None:
            raise ValueError(f"bad action {action!r}")
        s, kind, i = int(mt.group(1)), mt.group(2), int(mt.group(3))

        if kind == "F":
            if s == 0:
                x = xs[i]
            else:
                x = fwd_buf.pop((s, i)).requires_grad_(True)
            y = mods[s // p](x)
            inp[(s, i)] = x
            if s == S - 1:
                loss = loss_fn(y, ys[i])
                losses[i] = loss.detach()
                out[(s, i)] = loss / m
            else:
                out[(s, i)] = y
                meta[(s, i)] = (y.shape, y.dtype)
                if p == 1:
                    fwd_buf[(s + 1, i)] = y.detach()
                else:
                    send_f[(s, i)] = y.detach().contiguous()

        elif kind == "B":
            o, x = out.pop((s, i)), inp[(s, i)]
            g = None if s == S - 1 else bwd_buf.pop((s, i))
            leaves = params_of(s) + ([x] if s > 0 else [])
            if o.requires_grad and leaves:
                torch.autograd.backward(o, g, inputs=leaves)
            if s > 0:
                input_grad_done(s, i, x.grad)
            inp.pop((s, i))

        elif kind == "I":
            o, x = out[(s, i)], inp[(s, i)]
            g = None if s == S - 1 else bwd_buf.pop((s, i))
            wgrad[(s, i)] = g
            if s > 0:
                gx = None
                if o.requires_grad:
                    (gx,) = torch.autograd.grad(o, [x], g, retain_graph=True, allow_unused=True)
                input_grad_done(s, i, gx)

        elif kind == "W":
            o = out.pop((s, i))
            g = wgrad.pop((s, i))
            inp.pop((s, i))
            ps = params_of(s)
            if o.requires_grad and ps:
                torch.autograd.backward(o, g, inputs=ps)

        elif kind == "SEND_F":
            t = send_f.pop((s, i))
            if t.dim() > _HDR - 2:
                raise ValueError("activation has too many dimensions")
            hdr = torch.zeros(_HDR, dtype=torch.int64)
            hdr[0] = _DTYPES.index(t.dtype)
            hdr[1] = t.dim()
            hdr[2:2 + t.dim()] = torch.tensor(list(t.shape), dtype=torch.int64)
            dst = global_rank(s + 1)
            pending.append((dist.isend(hdr, dst, group=group, tag=_tag(s, i, m, False, True)), hdr))
            pending.append((dist.isend(t, dst, group=group, tag=_tag(s, i, m, False, False)), t))

        elif kind == "RECV_F":
            src = global_rank(s - 1)
            hdr = torch.zeros(_HDR, dtype=torch.int64)
            dist.recv(hdr, src, group=group, tag=_tag(s - 1, i, m, False, True))
            dtype = _DTYPES[int(hdr[0])]
            shape = [int(d) for d in hdr[2:2 + int(hdr[1])]]
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, src, group=group, tag=_tag(s - 1, i, m, False, False))
            fwd_buf[(s, i)] = buf

        elif kind == "SEND_B":
            t = send_b.pop((s, i))
            pending.append((dist.isend(t, global_rank(s - 1), group=group,
                                       tag=_tag(s - 1, i, m, True, False)), t))

        elif kind == "RECV_B":
            shape, dtype = meta.pop((s, i))
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, global_rank(s + 1), group=group, tag=_tag(s, i, m, True, False))
            bwd_buf[(s, i)] = buf

    for work, _ in pending:
        work.wait()

    if me == (S - 1) % p:
        total = None
        for i in range(m):
            total = losses[i] if total is None else total + losses[i]
        return (total / m).detach()
    return None
