"""The communication audit's rules, run in the driver over what each rank recorded
(harness/rank/recording.py; ``records_by_rank`` maps a global rank to its list of records). Each rule
returns a list of violations, one string per offending rank naming the rank, the calls and the
numbers; an empty list is a pass.

Bytes a rank sends ("charged" bytes):

* a ``send`` record: its payload bytes, exactly what left the rank;
* ``recv``, ``recv_anysource``, ``barrier``: nothing;
* a backend collective (allreduce, broadcast, ...): the rank's bound for that call from
  reference/cost_model.py, i.e. what the bandwidth-optimal algorithm sends; the backend's own
  algorithm is not visible, so a backend collective is charged by theory, and two of them where one
  suffices are charged twice.

Slack. Bounds are exact integers (uneven chunks are part of the formulas in cost_model) and record
bytes are tensor payloads only (no transport headers), so the byte rules allow nothing beyond the
bound; a rank may send less (e.g. a tree whose leaves forward nothing).
"""

from __future__ import annotations

from collections import Counter

from parallelism_conformance.harness.rank.recording import NEUTRAL_OPS, P2P_OPS
from parallelism_conformance.reference import cost_model

REDUCTIONS = ("allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced")
ALL_GATHERS = ("allgather", "allgather_coalesced", "allgather_into_tensor", "allgather_into_tensor_coalesced")
FLOATING = ("float64", "float32", "float16", "bfloat16")


class Cost(str):
    """Bytes above the theory's bound: *costs more*, not wrong (conformance/audit/common.py, check)."""


def _in_phase(records: list[dict], phase) -> list[dict]:
    """The records of ``phase``: a name, a tuple of names, or None for all."""
    if phase is None:
        return records
    phases = (phase,) if isinstance(phase, str) else tuple(phase)
    return [r for r in records if r.get("phase") in phases]


def charged_bytes(record: dict) -> int:
    """Bytes the call of ``record`` sends from its rank (see the module docstring)."""
    op = record["op"]
    if op == "send":
        return record["bytes"]
    if op in P2P_OPS or op in NEUTRAL_OPS:
        return 0
    n = len(record["group"])
    numel, itemsize = record["numel"], record["itemsize"]
    if record["bytes"] != numel * itemsize:  # mixed dtypes in one coalesced call: count in bytes
        numel, itemsize = record["bytes"], 1
    out_numel = record["out_bytes"] // itemsize if itemsize else 0
    if op in ("allreduce", "allreduce_coalesced"):
        return cost_model.all_reduce(n, numel, itemsize)
    if op == "broadcast":
        return cost_model.broadcast(n, numel, itemsize)
    if op == "reduce":
        return cost_model.reduce(n, numel, itemsize)
    if op in ALL_GATHERS:
        return cost_model.all_gather(n, out_numel, itemsize)
    if op.startswith("reduce_scatter"):
        return cost_model.reduce_scatter(n, numel, itemsize)
    if op in ("alltoall", "alltoall_base"):
        return cost_model.all_to_all(record["splits"], record["group"].index(record["rank"]))
    if op == "scatter":
        return cost_model.scatter(n, out_numel, itemsize)
    if op == "gather":
        return cost_model.gather(n, numel, itemsize)
    raise ValueError(f"no cost for recorded operation {op!r}")


def sent_bytes(records: list[dict], phase: str | None = None) -> int:
    return sum(charged_bytes(r) for r in _in_phase(records, phase))


def describe(records: list[dict]) -> str:
    """The calls, grouped: 'send x4 (160 B sent), allreduce x1 (40 B, charged 40 B)'."""
    if not records:
        return "no communication"
    calls: dict[str, list[dict]] = {}
    for r in records:
        calls.setdefault(r["op"], []).append(r)
    parts = []
    for op, rs in calls.items():
        if op == "send":
            parts.append(f"send x{len(rs)} ({sum(r['bytes'] for r in rs)} B sent)")
        elif op in P2P_OPS:
            parts.append(f"{op} x{len(rs)} ({sum(r['out_bytes'] for r in rs)} B received)")
        elif op in NEUTRAL_OPS:
            parts.append(f"{op} x{len(rs)}")
        else:
            parts.append(f"{op} x{len(rs)} ({sum(r['bytes'] for r in rs)} B in, charged {sum(map(charged_bytes, rs))} B)")
    return ", ".join(parts)


def _call(r: dict) -> str:
    where = f" root {r['root']}" if r["root"] is not None else ""
    return f"{r['op']}(group {r['group']}{where}, {r['dtype']}, {r['numel']} elements, {r['bytes']} B)"


# ----------------------------------------------------------------------------------- the rules
def point_to_point_only(records_by_rank: dict[int, list[dict]]) -> list[str]:
    """Built from point-to-point only: every call is send, recv or recv_anysource; any backend
    collective (barrier included) is a violation."""
    violations = []
    for rank, records in sorted(records_by_rank.items()):
        others = [r for r in records if r["op"] not in P2P_OPS]
        if others:
            shown = "; ".join(_call(r) for r in others[:3]) + (f"; ... {len(others) - 3} more" if len(others) > 3 else "")
            kinds = ", ".join(f"{op} x{k}" for op, k in Counter(r["op"] for r in others).items())
            violations.append(f"rank {rank}: {len(others)} backend collective call(s) ({kinds}), not point-to-point send/recv: {shown}")
    return violations


def within_bound(records_by_rank: dict[int, list[dict]], bounds: dict[int, int], what: str, phase: str | None = None) -> list[str]:
    """Each rank sends at most ``bounds[rank]`` bytes (a rank missing from ``bounds``: nothing);
    ``what`` names the bound's formula and inputs for the message."""
    violations = []
    where = f" in {phase}" if phase else ""
    for rank, records in sorted(records_by_rank.items()):
        mine = _in_phase(records, phase)
        sent, bound = sent_bytes(mine), bounds.get(rank, 0)
        if sent > bound:
            violations.append(
                Cost(
                    f"rank {rank}{where}: sent {sent} B, more than the bound {bound} B ({sent / bound:.2f}x) of {what}; its calls: {describe(mine)}"
                    if bound
                    else f"rank {rank}{where}: sent {sent} B where {what} sends nothing; its calls: {describe(mine)}"
                )
            )
    return violations


def gathered_in(records_by_rank: dict[int, list[dict]], dtype: str, what: str, phase: str | None = None) -> list[str]:
    """Every backend all-gather of floating data moves ``dtype`` (parameters cast before they are
    gathered). An all-gather built from sends is held to the byte bound instead: a send does not say
    what it is part of."""
    violations = []
    for rank, records in sorted(records_by_rank.items()):
        other = [r for r in _in_phase(records, phase) if r["op"] in ALL_GATHERS and r["dtype"] in FLOATING and r["dtype"] != dtype]
        if other:
            violations.append(
                f"rank {rank}: {len(other)} all-gather(s) of {what} in {other[0]['dtype']}, not {dtype}: "
                f"{'; '.join(_call(r) for r in other[:3])}"
            )
    return violations


def reduced_once(records_by_rank: dict[int, list[dict]], expected_bytes: int, what: str, phase: str | None = None) -> list[str]:
    """Backend reductions of floating-point data add up to ``expected_bytes`` on every rank that
    makes any: more means a gradient reduced twice or a frozen parameter reduced, less a gradient
    left out. Integer reductions (DDP's unused-parameter bitmap) are bookkeeping, not gradients.
    Ranks that reduce with point-to-point messages only are left to ``within_bound``."""
    violations = []
    where = f" in {phase}" if phase else ""
    for rank, records in sorted(records_by_rank.items()):
        reductions = [r for r in _in_phase(records, phase) if r["op"] in REDUCTIONS and r["dtype"] in FLOATING]
        if not reductions:
            continue
        total = sum(r["bytes"] for r in reductions)
        if total != expected_bytes:
            why = "a gradient reduced twice or a frozen parameter reduced" if total > expected_bytes else "some gradient not reduced"
            sizes = ", ".join(str(r["bytes"]) for r in reductions[:12]) + (", ..." if len(reductions) > 12 else "")
            found = (
                f"rank {rank}{where}: reduced {total} B of floating-point data in {len(reductions)} "
                f"call(s) ({sizes} B), but {what} total {expected_bytes} B, each to be reduced once ({why})"
            )
            # reducing more costs bytes (the values are judged by the capability's own tests); less
            # leaves a gradient unreduced, which no bound excuses
            violations.append(Cost(found) if total > expected_bytes else found)
    return violations


def starts_during_backward(records_by_rank: dict[int, list[dict]], what: str) -> list[str]:
    """Some communication of the step starts while backward still computes gradients (phase
    "backward", before the last gradient; what the last gradient's hook or
    finish_gradient_synchronization launches is "last_gradient" or "finish"): the point of
    bucketed DDP."""
    violations = []
    for rank, records in sorted(records_by_rank.items()):
        during = [r for r in _in_phase(records, "backward") if r["op"] not in NEUTRAL_OPS]
        at_end = [r for r in _in_phase(records, "last_gradient") if r["op"] not in NEUTRAL_OPS]
        later = [r for r in _in_phase(records, "finish") if r["op"] not in NEUTRAL_OPS]
        if not during:
            violations.append(
                f"rank {rank}: no communication started while backward still computed gradients "
                f"({len(at_end)} call(s) launched at the last gradient, {len(later)} in "
                f"finish_gradient_synchronization): {what}"
            )
    return violations


def bucket_sizes_allowed(parameter_bytes: list[int], cap_bytes: int) -> set[int]:
    """The sizes a bucket may have: the total of consecutive parameters (registration order, the
    order buckets are filled in, either direction) that was still under the cap before its last
    parameter was added: total - (its first or last parameter) < cap (DDP closes a bucket once it
    reaches the cap, so a bucket may exceed it by the one parameter that closed it)."""
    allowed = set()
    for start in range(len(parameter_bytes)):
        for end in range(start + 1, len(parameter_bytes) + 1):
            run = parameter_bytes[start:end]
            if sum(run) - max(run[0], run[-1]) < cap_bytes:
                allowed.add(sum(run))
    return allowed


def buckets_within_cap(
    records_by_rank: dict[int, list[dict]], cap_bytes: int, parameter_bytes: list[int], phase=("backward", "last_gradient", "finish")
) -> list[str]:
    """Every backend reduction of floating-point gradients is one bucket that respects the cap
    (``bucket_sizes_allowed``; ``parameter_bytes`` in registration order): sending every gradient
    in one reduction is caught. Bucket boundaries are visible only in backend calls: an
    implementation that reduces with point-to-point messages is not judged here."""
    violations = []
    allowed = bucket_sizes_allowed(parameter_bytes, cap_bytes)
    for rank, records in sorted(records_by_rank.items()):
        over = [
            r
            for r in _in_phase(records, phase)
            if r["op"] in REDUCTIONS and r["dtype"] in FLOATING and r["bytes"] > cap_bytes and r["bytes"] not in allowed
        ]
        if over:
            violations.append(
                Cost(
                    f"rank {rank}: {len(over)} reduction(s) that are not a bucket of at most bucket_size_mb "
                    f"= {cap_bytes} B (plus the one parameter that closes it; parameters of "
                    f"{parameter_bytes} B in registration order): {'; '.join(_call(r) for r in over[:3])}"
                )
            )
    return violations


def all_reduced_at_most(records_by_rank: dict[int, list[dict]], numel: int, what: str, phase: str | None = None) -> list[str]:
    """Backend all-reduces of floating data carry at most ``numel`` elements in all (``what`` says
    whose gradients may be all-reduced: fully sharded data parallelism reduce-scatters the rest).
    An all-reduce built from sends is held to the byte bound instead."""
    violations = []
    for rank, records in sorted(records_by_rank.items()):
        reduced = [r for r in _in_phase(records, phase) if r["op"] in ("allreduce", "allreduce_coalesced") and r["dtype"] in FLOATING]
        total = sum(r["numel"] for r in reduced)
        if total > numel:
            violations.append(
                Cost(
                    f"rank {rank}: all-reduces {total} elements where at most {numel} ({what}) may be; "
                    f"the others must be reduce-scattered: {'; '.join(_call(r) for r in reduced[:3])}"
                )
            )
    return violations


def no_full_all_gather(records_by_rank: dict[int, list[dict]], full_bytes: int, what: str, phase: str | None = None) -> list[str]:
    """No all-gather whose output is the whole of ``what`` (``full_bytes``): the layout keeps it
    sharded. Applies to backend all-gathers; point-to-point ones show up in ``within_bound``."""
    violations = []
    for rank, records in sorted(records_by_rank.items()):
        gathers = [r for r in _in_phase(records, phase) if r["op"] in ALL_GATHERS and r["out_bytes"] == full_bytes]
        if gathers:
            violations.append(
                Cost(
                    f"rank {rank}: {len(gathers)} all-gather(s) of the full {what} ({full_bytes} B), which "
                    f"the layout keeps sharded: {'; '.join(_call(r) for r in gathers[:3])}"
                )
            )
    return violations


# Transport overhead the kernel counts on top of payloads (measured on gloo, torch 2.13, 2-4 ranks):
# about 48 B per point-to-point message and per posted receive (gloo's preamble and its "ready"
# notice), and about 600 B per rank for a backend collective; allowed generously, so that only
# traffic the records do not explain is reported.
PER_P2P_CALL = 128
PER_COLLECTIVE_PER_MEMBER = 768
# torch's gloo reduce_scatter of a list writes more transport bytes than its other collectives:
# measured up to 1424 B per member beyond three times its charged bytes at n=4 (771 B at n=3),
# where every other collective stayed under 170 B (float32, 1-5000 elements, 2-4 ranks); a new torch
# or backend measures its own with perf/test_transport_allowance.py
PER_MEMBER_BY_OP = {"reduce_scatter": 2048}
FIXED = 1024
BACKEND_FACTOR = 3  # gloo's own algorithms may send up to twice the optimum (reduce_scatter as all-reduce)


def payload_explained(record: dict) -> int:
    """The bytes a call's own data explains: a point-to-point call its charge, a backend collective
    up to BACKEND_FACTOR times its charge (its algorithm is not visible)."""
    point_to_point = record["op"] in P2P_OPS or record["op"] in NEUTRAL_OPS
    return charged_bytes(record) * (1 if point_to_point else BACKEND_FACTOR)


def transport_allowance(record: dict) -> int:
    """The transport's own bytes allowed for a call on top of its payload (measured:
    perf/test_transport_allowance.py)."""
    if record["op"] in P2P_OPS or record["op"] in NEUTRAL_OPS:
        return PER_P2P_CALL
    return PER_MEMBER_BY_OP.get(record["op"], PER_COLLECTIVE_PER_MEMBER) * len(record["group"])


def unexplained_bytes(records: list[dict], written: int) -> tuple[int, int]:
    """(bytes the kernel saw the rank write beyond what its records explain, what they explain)."""
    explained = FIXED + sum(payload_explained(r) + transport_allowance(r) for r in records)
    return written - explained, explained


def accounted(records_by_rank: dict[int, list[dict]], written_by_rank: dict[int, int | None]) -> list[str]:
    """Every byte a rank wrote during the task, as the kernel counted it (/proc/<pid>/io, read by
    the driver: the rank can neither lower it nor reach it), is explained by its records, up to
    transport overhead. Traffic beyond that went around the recorder: a backend object called
    directly, the recorder patched or its records rewritten. Traffic below the overhead allowance
    (about a kilobyte) cannot be told from the transport's own."""
    violations = []
    for rank, records in sorted(records_by_rank.items()):
        written = written_by_rank.get(rank)
        if written is None:
            continue
        extra, explained = unexplained_bytes(records, written)
        if extra > 0:
            violations.append(
                f"rank {rank}: the kernel counted {written} B written during the task, {extra} B more "
                f"than its recorded calls explain ({describe(records)}; {explained} B with transport "
                f"overhead): communication that went around the recorder"
            )
    return violations


# ------------------------------------------------------------------------------- link classes
def bytes_by_link(records_by_rank: dict[int, list[dict]], layout, phase=None) -> dict[int, dict[str, int]]:
    """{rank: {link class: bytes}} on a reference.topology.HostLayout: a send is charged to the
    link to its peer, exactly; a backend collective's charged bytes to "within a host" when its
    whole group sits on one host, else to "across hosts" (its algorithm is not visible)."""
    from parallelism_conformance.reference.topology import ACROSS, WITHIN

    result = {}
    for rank, records in sorted(records_by_rank.items()):
        totals = {WITHIN: 0, ACROSS: 0}
        for record in _in_phase(records, phase):
            charged = charged_bytes(record)
            if not charged:
                continue
            if record["op"] == "send":
                totals[layout.link(rank, record["peer"])] += charged
            else:
                totals[ACROSS if layout.spans_hosts(record["group"]) else WITHIN] += charged
        result[rank] = totals
    return result


def groups_within_hosts(groups: list[list[int]], layout, what: str) -> list[str]:
    """Each group that spans hosts although a group of its size fits on one host: ``what`` (e.g.
    tensor parallelism, which communicates in every layer) belongs on the fast links."""
    return [
        f"{what} group {list(group)} spans hosts {sorted({layout.host_of(r) for r in group})} on {layout}, "
        f"though {len(group)} ranks fit on one host: it belongs on the fast links within a host"
        for group in groups
        if layout.spans_hosts(group) and layout.could_fit_one_host(group)
    ]


def bytes_by_axis(
    records_by_rank: dict[int, list[dict]], layout, axes: dict[str, list[list[int]]], phase=None
) -> dict[int, dict[str, dict[str, int]]]:
    """{rank: {axis: {link class: bytes}}}: every byte a rank sends charged to the mesh axis it
    travels along (``axes``: {"tp": groups, "pp": groups, "dp": groups}, e.g. reference.mesh.Mesh's)
    and to the link it crosses on ``layout``. A send belongs to the axis whose group of this rank
    holds its peer; a backend collective to the axis whose group is exactly its group; anything else
    to "other" (traffic along no axis of the mesh: a strategy talking to the wrong ranks)."""
    from parallelism_conformance.reference.topology import ACROSS, WITHIN

    result = {}
    for rank, records in sorted(records_by_rank.items()):
        mine = {axis: next((g for g in groups if rank in g), []) for axis, groups in axes.items()}
        totals = {axis: {WITHIN: 0, ACROSS: 0} for axis in [*axes, "other"]}
        for record in _in_phase(records, phase):
            charged = charged_bytes(record)
            if not charged:
                continue
            if record["op"] == "send":
                axis = next((a for a, g in mine.items() if record["peer"] in g and record["peer"] != rank), "other")
                totals[axis][layout.link(rank, record["peer"])] += charged
            else:
                members = sorted(record["group"])
                axis = next((a for a, g in mine.items() if sorted(g) == members), "other")
                totals[axis][ACROSS if layout.spans_hosts(members) else WITHIN] += charged
        result[rank] = totals
    return result


def link_report(by_axis: dict[int, dict[str, dict[str, int]]]) -> str:
    """One line per axis: bytes sent within a host and across hosts, summed over ranks."""
    from parallelism_conformance.reference.topology import ACROSS, WITHIN

    axes = next(iter(by_axis.values())).keys() if by_axis else []
    lines = []
    for axis in axes:
        within = sum(r[axis][WITHIN] for r in by_axis.values())
        across = sum(r[axis][ACROSS] for r in by_axis.values())
        if within or across or axis != "other":
            lines.append(f"{axis}: {within} B {WITHIN}, {across} B {ACROSS}")
    return "; ".join(lines)
