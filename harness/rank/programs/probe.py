"""Probing what the backend itself accepts, once per session, with torch.distributed's own
collectives on tiny tensors. The driver turns refusals into skips with the backend's message."""

from __future__ import annotations

import sys

import torch

from parallelism_conformance.harness.rank.context import RankContext
from parallelism_conformance.harness.rank.programs.collectives import keyword_arguments


def native_refusals(ctx: RankContext, impl, calls: list[tuple[tuple, str, dict]]) -> dict:
    """For each (case, function, this member's keyword arguments), as the driver built them from
    conformance/collective_table.py: torch.distributed's own function called on the world, and the
    backend's error message, or None where it accepted the call."""
    import torch.distributed as dist

    refusals = {}
    for case, function, arguments in calls:
        try:
            getattr(dist, function)(**keyword_arguments(ctx, arguments))
            refusals[case] = None
        except Exception as error:  # noqa: BLE001 - a refusal is what we are looking for
            refusals[case] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    return refusals


def rank_environment(ctx: RankContext, impl) -> dict:
    """What a rank runs with: torch's thread counts, default dtype, grad mode, the device, and whether
    it would write bytecode (it must not: the audit counts every byte a rank writes)."""
    return {
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "default_dtype": str(torch.get_default_dtype()),
        "grad_enabled": torch.is_grad_enabled(),
        "device": str(ctx.device),
        "writes_bytecode": not sys.dont_write_bytecode,
    }


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
