"""Probing what the backend itself accepts, once per session, with torch.distributed's own
collectives on tiny tensors. The driver turns refusals into skips with the backend's message."""
from __future__ import annotations

import sys

import torch

from harness.rank.context import RankContext


def _tensor(dtype, numel, device):
    return torch.ones(numel, dtype=dtype, device=device)


def native_refusals(ctx: RankContext, impl, cases: list[tuple[str, str, str | None]]) -> dict:
    """For each (collective, dtype name, op name or None): the backend's error message, or None."""
    import torch.distributed as dist

    n = ctx.world_size
    refusals = {}
    for collective, dtype_name, op in cases:
        dtype = getattr(torch, dtype_name)
        kw = {} if op is None else {"op": getattr(dist.ReduceOp, op)}
        x = _tensor(dtype, n, ctx.device)
        try:
            if collective in ("all_reduce",):
                dist.all_reduce(x, **kw)
            elif collective == "reduce":
                dist.reduce(x, dst=0, **kw)
            elif collective == "reduce_scatter":
                dist.reduce_scatter(_tensor(dtype, 1, ctx.device), list(x.split(1)), **kw)
            elif collective == "reduce_scatter_tensor":
                dist.reduce_scatter_tensor(_tensor(dtype, 1, ctx.device), x, **kw)
            elif collective == "broadcast":
                dist.broadcast(x, src=0)
            elif collective == "scatter":
                dist.scatter(_tensor(dtype, 1, ctx.device), list(x.split(1)) if ctx.rank == 0 else None, src=0)
            elif collective == "gather":
                dist.gather(_tensor(dtype, 1, ctx.device), list(x.split(1)) if ctx.rank == 0 else None, dst=0)
            elif collective == "all_gather":
                dist.all_gather(list(x.split(1)), _tensor(dtype, 1, ctx.device))
            elif collective == "all_gather_into_tensor":
                dist.all_gather_into_tensor(x, _tensor(dtype, 1, ctx.device))
            elif collective == "all_to_all":
                dist.all_to_all(list(x.clone().split(1)), list(x.split(1)))
            elif collective == "all_to_all_uneven":  # rank r sends r + 1 elements to everyone
                ins = [_tensor(dtype, ctx.rank + 1, ctx.device) for _ in range(n)]
                dist.all_to_all([_tensor(dtype, peer + 1, ctx.device) for peer in range(n)], ins)
            elif collective == "all_to_all_single":
                dist.all_to_all_single(x.clone(), x)
            else:
                raise ValueError(f"no probe for {collective}")
            refusals[(collective, dtype_name, op)] = None
        except Exception as error:  # noqa: BLE001 - a refusal is what we are looking for
            refusals[(collective, dtype_name, op)] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    return refusals


def rank_environment(ctx: RankContext, impl) -> dict:
    """What a rank runs with: torch's thread counts, default dtype, grad mode, the device, and whether
    it would write bytecode (it must not: the audit counts every byte a rank writes)."""
    return {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "default_dtype": str(torch.get_default_dtype()), "grad_enabled": torch.is_grad_enabled(),
            "device": str(ctx.device), "writes_bytecode": not sys.dont_write_bytecode}


STRAY_MAGIC = 0x5EED_C0DE
STRAY_BOX = 8192  # int64 elements: a leftover message of up to 64 KiB is caught and shown
_SENTINELS_IN_FLIGHT: list = []  # (work, tensor) of this rank's last sentinel sends


def stray_messages(ctx: RankContext, impl) -> dict:
    """After a task every rank finished: is a point-to-point message that the implementation sent
    and nobody received still queued? Every rank sends every other rank a 16-byte sentinel with
    tag 0 (what send/isend use by default) and receives one from each into a 64 KiB box (gloo
    accepts a smaller message into a larger buffer). A leftover message from a peer arrives first
    and takes the sentinel's place. Returns {"leftovers": {peer: first int64 words received}}.
    A receive the implementation posted and never matched takes a sentinel instead, and this
    program then waits: the driver reports that as the check hanging."""
    import torch.distributed as dist

    peers = [p for p in range(ctx.world_size) if p != ctx.rank]
    mine = torch.tensor([STRAY_MAGIC, ctx.rank], dtype=torch.int64, device=ctx.device)
    boxes = {p: torch.full((STRAY_BOX,), -1, dtype=torch.int64, device=ctx.device) for p in peers}
    for work, _ in _SENTINELS_IN_FLIGHT:  # the last check's sends: matched, since it found nothing
        work.wait()
    receives = [dist.irecv(boxes[p], src=p) for p in peers]
    _SENTINELS_IN_FLIGHT[:] = [(dist.isend(mine, dst=p), mine) for p in peers]
    for work in receives:
        work.wait()
    # Sends are not waited for here: behind a leftover message, a sentinel is never received (its
    # receive took the leftover), and its sender would wait forever; the driver rebuilds that world.
    return {"leftovers": {p: boxes[p][:4].tolist() for p in peers if boxes[p][:2].tolist() != [STRAY_MAGIC, p]}}
