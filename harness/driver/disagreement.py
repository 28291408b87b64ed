"""When ranks disagree: the driver reads every rank's flight recorder (harness/rank/flight_recorder.py)
after a task failed (a hang, a crash, a stray message) and names the first disagreement between
the ranks' calls, with their source lines:

* a message whose sender and receiver disagree on its size, dtype or tag (the k-th send from a to
  b is matched with the k-th receive on b from a, as gloo and NCCL match them);
* a send nobody received, a receive nobody sent to (a peer mistaken: its send went elsewhere);
* a collective that members called differently (another operation, size or root), or that some
  members never called while the others wait in it;
* ranks that each wait to receive from the next, in a cycle.

Driver side only; the rings are files the ranks mapped, read after the fact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from parallelism_conformance.harness.rank.flight_recorder import DTYPES, HEADER, MAGIC, OPS, P2P, SLOT, STATES

MAX_LINES = 6


@dataclass(frozen=True)
class Call:
    rank: int
    index: int  # order within the rank's task
    op: str
    state: str
    dtype: str
    shape: tuple[int, ...]
    peer: int | None
    root: int | None
    tag: int
    sequence: int  # k-th send to peer / receive from peer / collective on this group, in the task
    members: tuple[int, ...]
    numel: int
    nbytes: int
    where: str  # file:line of the implementation

    def describe(self) -> str:
        size = f"{self.numel} x {self.dtype} = {self.nbytes} B" if self.dtype else f"{self.nbytes} B"
        if self.op in P2P:
            whom = f"to {self.peer}" if self.op == "send" else ("from any" if self.peer is None else f"from {self.peer}")
            tag = f", tag {self.tag}" if self.tag else ""
            return f"{self.op}({whom}, {size}{tag}) at {self.where}"
        root = f", root {self.root}" if self.root is not None else ""
        group = f"group {list(self.members)}, " if self.members else ""
        return f"{self.op}({group}{size}{root}) at {self.where}"


def read(path: str) -> tuple[int, list[Call]] | None:
    """(task number, the calls of that task in order) from one rank's ring file, or None."""
    try:
        with open(path, "rb") as ring:
            data = ring.read()
    except OSError:
        return None
    if len(data) < HEADER.size:
        return None
    magic, capacity, task = HEADER.unpack_from(data, 0)[:3]
    if magic != MAGIC:
        return None
    rank = _rank_of(path)
    found = []
    for slot in range(capacity):  # slots of other tasks, or never written (task 0, index 0), are skipped
        offset = HEADER.size + slot * SLOT.size
        if offset + SLOT.size > len(data):
            break
        (
            slot_task,
            index,
            op,
            state,
            dtype,
            ndim,
            peer,
            root,
            tag,
            sequence,
            group_size,
            mask,
            numel,
            nbytes,
            d0,
            d1,
            d2,
            d3,
            line,
            filename,
        ) = SLOT.unpack_from(data, offset)
        if slot_task != task or index == 0:
            continue
        members = tuple(r for r in range(64) if mask >> r & 1) if group_size <= 64 else ()
        where = f"{os.path.basename(filename.rstrip(bytes(1)).decode(errors='replace'))}:{line}"
        found.append(
            Call(
                rank,
                index,
                OPS[op] if op < len(OPS) else "?",
                STATES[state] if state < len(STATES) else "?",
                DTYPES[dtype] if dtype < len(DTYPES) else "?",
                (d0, d1, d2, d3)[:ndim],
                None if peer < 0 else peer,
                None if root < 0 else root,
                tag,
                sequence,
                members,
                numel,
                nbytes,
                where,
            )
        )
    return task, sorted(found, key=lambda c: c.index)


def _rank_of(path: str) -> int:
    stem = os.path.basename(path).rsplit("-rank", 1)[-1]
    return int(stem.split(".")[0]) if stem.split(".")[0].isdigit() else -1


def from_flight_recorders(rings: dict[int, str | None], status: dict[int, str]) -> list[str]:
    """The first disagreements between the calls the ranks' flight recorders (``rings``: rank -> its
    ring file) hold for the last task they recorded; [] when they agree or any cannot be read (an
    attached rank has no ring here)."""
    calls = {}
    for rank, ring in rings.items():
        found = read(ring) if ring is not None else None
        if found is None:
            return []
        calls[rank] = found[1]
    return explain(calls, status)


def explain(calls_by_rank: dict[int, list[Call]], status: dict[int, str]) -> list[str]:
    """Lines naming the disagreements, the first (most telling) first; [] when the ranks agree.
    ``status``: each rank's outcome ("ok", "hung", "exited", "raised", ...)."""
    mismatched, unmatched = _messages(calls_by_rank, status)
    lines = mismatched + _collectives(calls_by_rank, status) + _cycles(calls_by_rank, status) + unmatched
    return lines[:MAX_LINES]


def _messages(calls_by_rank, status) -> tuple[list[str], list[str]]:
    sends, recvs = {}, {}
    for rank, calls in calls_by_rank.items():
        for call in calls:
            if call.op == "send":
                sends.setdefault((rank, call.peer), []).append(call)
            elif call.op == "recv" and call.peer is not None:
                recvs.setdefault((call.peer, rank), []).append(call)
    lines, unmatched = [], []
    for pair in sorted(set(sends) | set(recvs)):
        # the k-th send from a to b meets the k-th receive on b from a (sequence numbers survive the
        # ring's wrap-around: a number older than what the other ring still holds is not judged)
        out = {c.sequence: c for c in sends.get(pair, [])}
        into = {c.sequence: c for c in recvs.get(pair, [])}
        for k in sorted(set(out) & set(into)):
            send, recv = out[k], into[k]
            differs = [
                what
                for what, a, b in (("size", send.nbytes, recv.nbytes), ("dtype", send.dtype, recv.dtype), ("tag", send.tag, recv.tag))
                if a != b
            ]
            if differs:
                lines.append(f"{' and '.join(differs)} mismatch: rank {send.rank}: {send.describe()}; rank {recv.rank}: {recv.describe()}")
        src, dst = pair
        for k in sorted(out):
            if k not in into and k > max(into, default=0) and dst in calls_by_rank:
                unmatched.append(
                    f"rank {src}: {out[k].describe()} was never received: rank {dst} posted no matching "
                    f"receive{_last(calls_by_rank, dst, status)}"
                )
        for k in sorted(into):
            if k not in out and k > max(out, default=0) and src in calls_by_rank:
                unmatched.append(
                    f"rank {dst}: {into[k].describe()} waits for a message rank {src} never sent{_last(calls_by_rank, src, status)}"
                )
    return lines, unmatched


def _last(calls_by_rank, rank, status) -> str:
    calls = calls_by_rank.get(rank, [])
    state = status.get(rank, "")
    how = f" (rank {rank} {state})" if state and state != "ok" else ""
    return f"; rank {rank}'s last call: {calls[-1].describe()}{how}" if calls else f"; rank {rank} made no call{how}"


# collectives whose members legitimately pass different amounts of data (recorded: the input
# tensors): all-to-alls with per-pair splits, and scatter, whose input only its root has
SIZES_MAY_DIFFER = frozenset({"all_to_all", "all_to_all_single", "scatter"})


def _collectives(calls_by_rank, status) -> list[str]:
    lines = []
    groups = {}
    for rank, calls in calls_by_rank.items():
        for call in calls:
            if call.op not in P2P and call.members:
                groups.setdefault(call.members, {}).setdefault(rank, []).append(call)
    for members, by_rank in sorted(groups.items()):
        present = [r for r in members if r in calls_by_rank]
        numbered = {r: {c.sequence: c for c in by_rank.get(r, [])} for r in present}
        for k in sorted(set().union(*(set(n) for n in numbered.values()))):
            at = {r: numbered[r][k] for r in present if k in numbered[r]}
            kinds = {}
            for r, call in at.items():
                size = None if call.op in SIZES_MAY_DIFFER else call.nbytes
                kinds.setdefault((call.op, size, call.root), []).append(r)
            if len(kinds) > 1:
                parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} called {at[rs[0]].describe()}" for rs in kinds.values()]
                lines.append(f"collective mismatch in group {list(members)} (its call #{k}): " + "; ".join(parts))
                break
            missing = [r for r in present if r not in at and k > max(numbered[r], default=0)]
            if missing:
                waiting = sorted(at)
                call = at[waiting[0]]
                lines.append(
                    f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never called the "
                    f"{call.op} ({call.describe()}) that rank{'s' if len(waiting) > 1 else ''} "
                    f"{', '.join(map(str, waiting))} {'are' if len(waiting) > 1 else 'is'} waiting in"
                    + "".join(_last(calls_by_rank, r, status) for r in missing)
                )
                break
    return lines


def _cycles(calls_by_rank, status) -> list[str]:
    """Ranks that hang, each in a receive from the next, in a cycle (no matching send on the way)."""
    waits = {}
    for rank, calls in calls_by_rank.items():
        if status.get(rank) != "hung" or not calls:
            continue
        last = calls[-1]
        if last.op == "recv" and last.peer is not None:
            waits[rank] = last
    lines, seen = [], set()
    for start in sorted(waits):
        path, rank = [], start
        while rank in waits and rank not in path:
            path.append(rank)
            rank = waits[rank].peer
        if rank == start and len(path) > 1 and not set(path) & seen:
            seen |= set(path)
            names = " and ".join(map(str, path)) if len(path) == 2 else ", ".join(map(str, path))
            lines.append(f"ranks {names} all wait to receive from each other: " + "; ".join(f"rank {r}: {waits[r].describe()}" for r in path))
    return lines
