"""Bug: each stage keeps its saved activations in a FIFO queue and pops the oldest one on backward, so a schedule whose backwards on a stage do not follow its forward order back-propagates a gradient through another microbatch's activation.
verdict: fail
capability: pipeline_parallel

A runtime first written for GPipe and 1F1B, where every stage runs its backwards in the order of its
forwards, keeps per stage a deque of (input, output) pairs and pops from the front. That is right
for the generated schedules (interleaved too, since each chunk stays in microbatch order), and it is
the classic "activation queue" of tutorial pipeline code, but a valid callable schedule may run the
backwards of a stage in any order after their forwards: the gradient received for microbatch i is
then applied to the activation of microbatch j, silently giving wrong parameter gradients.
"""
import re
import time
from collections import defaultdict, deque

import torch
import torch.distributed as dist

_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)$")
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_MAX_DIMS = 12


# --------------------------------------------------------------------------- schedules
def _compute_order(kind, p, m, v, r):
    """The compute actions (stage, 'F'|'B', microbatch) of rank r."""
    if kind == "gpipe":
        return [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)]
    if kind == "1f1b" or (kind == "interleaved" and v == 1):
        warm = min(p - 1 - r, m)
        out = [(r, "F", i) for i in range(warm)]
        for j in range(m - warm):
            out.append((r, "F", warm + j))
            out.append((r, "B", j))
        out += [(r, "B", i) for i in range(m - warm, m)]
        return out
    # Megatron interleaved, v > 1
    total = v * m

    def fwd(k):
        chunk = (k % (p * v)) // p
        mb = (k // (p * v)) * p + k % p
        return (chunk * p + r, "F", mb)

    def bwd(k):
        chunk = v - 1 - (k % (p * v)) // p
        mb = (k // (p * v)) * p + k % p
        return (chunk * p + r, "B", mb)

    warm = min((v - 1) * p + 2 * (p - 1 - r), total)
    out = [fwd(k) for k in range(warm)]
    for j in range(total - warm):
        out.append(fwd(warm + j))
        out.append(bwd(j))
    out += [bwd(k) for k in range(total - warm, total)]
    return out


def generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank=1):
    """One list of compact actions ("0F3", "1SEND_B2", ...) per rank, for "gpipe", "1f1b" or "interleaved"."""
    p, m, v = int(num_ranks), int(num_microbatches), int(stages_per_rank)
    if kind not in ("gpipe", "1f1b", "interleaved"):
        raise ValueError(f"unknown schedule kind {kind!r}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError("num_ranks, num_microbatches and stages_per_rank must be >= 1")
    if kind in ("gpipe", "1f1b") and v != 1:
        raise ValueError(f"{kind} takes stages_per_rank=1, got {v}")
    if kind == "interleaved" and v > 1 and m % p != 0:
        raise ValueError(f"interleaved needs num_microbatches ({m}) to be a multiple of num_ranks ({p})")
    S = p * v
    rows = []
    for r in range(p):
        row = []
        for s, k, i in _compute_order(kind, p, m, v, r):
            if k == "F":
                if s > 0 and (s - 1) % p != r:
                    row.append(f"{s}RECV_F{i}")
                row.append(f"{s}F{i}")
                if s < S - 1 and (s + 1) % p != r:
                    row.append(f"{s}SEND_F{i}")
            else:
                if s < S - 1 and (s + 1) % p != r:
                    row.append(f"{s}RECV_B{i}")
                row.append(f"{s}B{i}")
                if s > 0 and (s - 1) % p != r:
                    row.append(f"{s}SEND_B{i}")
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ runtime
def _tag(boundary, mb, backward, part, S):
    return ((mb * S + boundary) * 2 + int(backward)) * 2 + part


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, trace=None):
    """Run one training step of the pipeline; every stage parameter ends with the gradient of the
    mean over microbatches of the loss; the rank holding the last stage returns that loss."""
    chunks = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    p = dist.get_world_size(group)
    r = dist.get_rank(group)
    v = len(chunks)
    m = int(num_microbatches)
    S = p * v

    def glob(q):
        return q if group is None else dist.get_global_rank(group, q)

    def module(s):
        return chunks[s // p]

    if callable(schedule):
        rows = schedule(p, m, v)
    else:
        rows = generate_schedule(schedule, p, m, v)
    row = list(rows[r])

    xs = list(torch.tensor_split(inputs, m, dim=0)) if r == 0 else None
    ys = list(torch.tensor_split(targets, m, dim=0)) if r == (S - 1) % p else None

    stash = {}          # (s, i) -> output, for sends and gradient shapes
    saved = defaultdict(deque)  # s -> (input, output) in forward order
    losses = {}         # i -> loss tensor (with graph) on the last stage
    loss_values = {}    # i -> detached loss
    act_in = {}         # (s, i) -> activation arriving at stage s
    grad_out = {}       # (s, i) -> gradient of the output of stage s
    grad_in = {}        # (s, i) -> gradient of the input of stage s
    pending = []        # (work, tensor) of isends

    for action in row:
        match = _ACTION.match(action)
        if match is None:
            raise ValueError(f"bad action {action!r}")
        s, kind, i = int(match.group(1)), match.group(2), int(match.group(3))
        t0 = time.perf_counter()

        if kind == "F":
            if s == 0:
                x = xs[i]
            else:
                x = act_in.pop((s, i)).detach().requires_grad_(True)
            out = module(s)(x)
            stash[(s, i)] = out
            saved[s].append((x, out))
            if s == S - 1:
                loss = loss_fn(out, ys[i])
                losses[i] = loss
                loss_values[i] = loss.detach()
            elif (s + 1) % p == r:
                act_in[(s + 1, i)] = out.detach()

        elif kind == "B":
            stash.pop((s, i))
            x, out = saved[s].popleft()
            if s == S - 1:
                torch.autograd.backward(losses.pop(i) / m)
            else:
                g = grad_out.pop((s, i))
                if out.requires_grad:
                    torch.autograd.backward(out, grad_tensors=g)
            if s > 0:
                gx = x.grad if x.grad is not None else torch.zeros_like(x)
                if (s - 1) % p == r:
                    grad_out[(s - 1, i)] = gx
                else:
                    grad_in[(s, i)] = gx

        elif kind == "SEND_F":
            out = stash[(s, i)].detach().contiguous()
            dst = glob((s + 1) % p)
            header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64)
            header[0] = _DTYPES.index(out.dtype)
            header[1] = out.dim()
            header[2:2 + out.dim()] = torch.tensor(out.shape, dtype=torch.int64)
            pending.append((dist.isend(header, dst, group=group, tag=_tag(s, i, False, 0, S)), header))
            pending.append((dist.isend(out, dst, group=group, tag=_tag(s, i, False, 1, S)), out))

        elif kind == "RECV_F":
            src = glob((s - 1) % p)
            header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64)
            dist.recv(header, src, group=group, tag=_tag(s - 1, i, False, 0, S))
            dtype = _DTYPES[int(header[0])]
            shape = [int(d) for d in header[2:2 + int(header[1])]]
            buf = torch.empty(shape, dtype=dtype)
            dist.recv(buf, src, group=group, tag=_tag(s - 1, i, False, 1, S))
            act_in[(s, i)] = buf

        elif kind == "SEND_B":
            g = grad_in.pop((s, i)).contiguous()
            dst = glob((s - 1) % p)
            pending.append((dist.isend(g, dst, group=group, tag=_tag(s - 1, i, True, 1, S)), g))

        elif kind == "RECV_B":
            out = stash[(s, i)]
            buf = torch.empty(out.shape, dtype=out.dtype)
            dist.recv(buf, glob((s + 1) % p), group=group, tag=_tag(s, i, True, 1, S))
            grad_out[(s, i)] = buf

        if trace is not None:
            trace.append((action, t0, time.perf_counter()))

    for work, _ in pending:
        work.wait()

    if r == (S - 1) % p:
        return (torch.stack([loss_values[i] for i in range(m)]).sum() / m).detach()
    return None


__all__ = ["pipeline_step", "generate_schedule"]
