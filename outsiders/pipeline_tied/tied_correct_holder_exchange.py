"""Correct: the holders of a tied weight swap their local sums point to point and each adds them in holder order; clipping counts the weight once, on its lowest holder.

verdict: pass
capability: pipeline_tied

Written from the contract alone, self-contained like the other outsiders (nothing is imported from
the bundled package). Placement everywhere: stage s on group rank s mod p, as element s // p of the
rank's list of stages (a bare module is a list of one).

``sync_tied_gradients`` resolves every ``(stage, name)`` entry on the rank that holds the stage and
keeps the distinct Parameter objects in the order of the list, so one Parameter listed under two
stages of the same rank (p = 1) is one copy, while two distinct Parameters on one rank are two. The
holders are the group ranks of the listed stages, known to every rank from the shared list; a rank
outside them returns at once. Each holder adds its distinct copies' gradients (a missing ``.grad`` as
zeros) into one local sum, isends it to every other holder and receives theirs, then adds the local
sums in increasing holder rank; the same additions in the same order make the result bitwise the
same on every holder, and it is written into every copy's ``.grad``.

``clip_grad_norm_`` takes the distinct parameters with a ``.grad`` of the stages on this rank. With
``tied``, the tied weight is counted on the lowest holder only, as one of its copies there; every
other copy is left out of the norm (its gradient is the same after the sync). Each rank computes its
partial (the sum of |g|^q in float64, or the max for inf); with ``pp_group`` the partials are
all-gathered and combined in rank order, so N is bitwise the same on every rank, and returned as a
0-dim tensor in the gradients' dtype (the widest dtype any rank holds). Every gradient of this rank,
every tied copy included, is multiplied by min(1, max_norm / (N + 1e-6)).

``pipeline_step`` is the bundled runtime's (``from impls import pipeline_step``): this author
wrote the tied weight's synchronisation and clipping from the contract; the runtime that
follows a given schedule is another capability's.
"""
import math

import torch
import torch.distributed as dist

# pipeline_step is the bundled runtime's: the capability checks the tied weight, and the schedule a
# runtime must follow is another capability's contract, not this author's
from parallelism_conformance.impls import pipeline_step  # noqa: F401



# --------------------------------------------------------------------------- placement

def _group_info(group):
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    if group is None:
        peers = list(range(n))
    else:
        peers = [dist.get_global_rank(group, q) for q in range(n)]
    return n, me, peers


def _as_list(stages):
    if isinstance(stages, (list, tuple)):
        return list(stages)
    return [stages]


def _tied_params(stages, tied, p, me):
    """The distinct Parameters of the tied entries that live on group rank ``me``, in list order."""
    local = _as_list(stages)
    seen, out = set(), []
    for s, name in tied:
        if s % p != me:
            continue
        param = local[s // p].get_parameter(name)
        if id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return out


# --------------------------------------------------------------------------- tied gradients

def sync_tied_gradients(stages, tied, group=None):
    tied = [(int(s), str(name)) for s, name in tied]
    if not tied:
        return
    p, me, peers = _group_info(group)
    holders = sorted({s % p for s, _ in tied})
    if me not in holders:
        return
    copies = _tied_params(stages, tied, p, me)
    local = None
    for param in copies:
        g = param.grad if param.grad is not None else torch.zeros_like(param)
        local = g.detach().clone() if local is None else local + g
    parts = {me: local}
    if len(holders) > 1:
        reqs = []
        for q in holders:
            if q == me:
                continue
            buf = torch.empty_like(local)
            parts[q] = buf
            reqs.append(dist.isend(local, peers[q], group=group))
            reqs.append(dist.irecv(buf, peers[q], group=group))
        for req in reqs:
            req.wait()
    total = None
    for q in holders:
        total = parts[q].clone() if total is None else total + parts[q]
    for param in copies:
        if param.grad is None:
            param.grad = total.clone()
        else:
            param.grad.copy_(total)


# --------------------------------------------------------------------------- clipping

def clip_grad_norm_(module, max_norm, norm_type=2.0, pp_group=None, tied=None):
    norm_type = float(norm_type)
    mods = _as_list(module)
    params, seen = [], set()
    for mod in mods:
        for param in mod.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    with_grad = [q for q in params if q.grad is not None]

    counted = with_grad
    if tied:
        tied = [(int(s), str(name)) for s, name in tied]
        p, me, _ = _group_info(pp_group)
        holders = sorted({s % p for s, _ in tied})
        mine = _tied_params(module, tied, p, me)
        skip = {id(q) for q in mine}
        if mine and me == holders[0]:
            skip.discard(id(mine[0]))
        counted = [q for q in with_grad if id(q) not in skip]

    if norm_type == math.inf:
        partial = max((float(q.grad.detach().abs().max()) for q in counted if q.grad.numel()),
                      default=0.0)
    else:
        partial = 0.0
        acc = torch.zeros((), dtype=torch.float64)
        for q in counted:
            acc = acc + q.grad.detach().double().abs().pow(norm_type).sum().cpu()
        partial = float(acc)
    width = max((torch.finfo(q.grad.dtype).bits for q in with_grad
                 if q.grad.dtype.is_floating_point), default=32)

    mine_vec = torch.tensor([partial, float(width)], dtype=torch.float64)
    if pp_group is not None:
        n = dist.get_world_size(pp_group)
        got = [torch.empty_like(mine_vec) for _ in range(n)]
        dist.all_gather(got, mine_vec, group=pp_group)
    else:
        got = [mine_vec]
    width = int(max(float(v[1]) for v in got))
    out_dtype = {64: torch.float64, 32: torch.float32, 16: torch.float32}[width]
    if norm_type == math.inf:
        total = max(float(v[0]) for v in got)
        norm = torch.tensor(total, dtype=torch.float64)
    else:
        total = torch.zeros((), dtype=torch.float64)
        for v in got:
            total = total + v[0]
        norm = total.pow(1.0 / norm_type)
    norm = norm.to(out_dtype)

    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for q in with_grad:
        q.grad.detach().mul_(coef.to(device=q.grad.device, dtype=q.grad.dtype))
    return norm
