"""The backend collectives of a relay world, computed by the relay (harness/driver/relay.py) from
every member's inputs, in the driver, where no rank reaches. The formulas are torch.distributed's
documented semantics; a reduction is the oracle's own (reference/collectives.py: ``reduce_values``,
floating point summed in float64 in group-rank order and cast once), so every member gets the same
bits.

A call is described by its member (harness/rank/relay_transport.py: RelayBackend) as JSON: ``op``,
``group`` (global ranks), ``dtype``, ``inputs`` and ``outputs`` (element counts of its tensors, in
order), ``reduce``, ``root`` (a group rank), and for all_to_all_single ``in_splits`` and
``out_splits`` (element counts). The members' descriptions must agree: a member that calls another
collective, another dtype or another root, or sizes that do not fit, is refused (gloo would hang or
abort), naming the members."""

from __future__ import annotations

import torch

from parallelism_conformance.reference.collectives import reduce_values

DTYPES = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64", "complex128")
}
OPS = (
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "reduce",
    "allgather",
    "allgather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "alltoall",
    "alltoall_base",
    "gather",
    "scatter",
)


class Refused(ValueError):
    """The members' calls do not make one collective the relay can compute."""


def itemsize(dtype: str) -> int:
    if dtype not in DTYPES:
        raise Refused(f"the relay computes no collective of dtype {dtype!r}")
    return torch.empty(0, dtype=DTYPES[dtype]).element_size()


def tensors(description: dict, data: bytes) -> list[torch.Tensor]:
    """A member's inputs as flat tensors; Refused where its bytes do not match what it described."""
    sizes, size = description["inputs"], itemsize(description["dtype"])
    if not all(isinstance(n, int) and n >= 0 for n in sizes) or sum(sizes) * size != len(data):
        raise Refused(f"{len(data)} B of input for input tensors of {sizes} elements of {description['dtype']}")
    flat = torch.frombuffer(bytearray(data), dtype=DTYPES[description["dtype"]]) if data else torch.empty(0, dtype=DTYPES[description["dtype"]])
    return list(flat.split(sizes)) if sizes else []


def compute(calls: list[dict], inputs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each member's output, one flat tensor (its output tensors' elements, in order)."""
    first = calls[0]
    for key in ("op", "group", "dtype", "reduce", "root"):
        differing = sorted({str(call.get(key)) for call in calls})
        if len(differing) > 1:
            raise Refused(
                f"the members of group {first['group']} disagree on the call's {key}: "
                + ", ".join(f"rank {g} {call.get(key)}" for g, call in zip(first["group"], calls))
            )
    op, n = first["op"], len(calls)
    if op not in OPS:
        raise Refused(f"the relay computes no collective {op!r}")
    root = first["root"]
    if op in ("broadcast", "reduce", "gather", "scatter") and not (isinstance(root, int) and 0 <= root < n):
        raise Refused(f"{op} with root {root} in a group of {n}")
    flat = [torch.cat(ins) if ins else torch.empty(0, dtype=DTYPES[first["dtype"]]) for ins in inputs]
    if op in ("allreduce", "allreduce_coalesced", "broadcast", "reduce"):
        _same_sizes(calls, "inputs")
        if op == "broadcast":
            return [flat[root].clone() for _ in range(n)]
        total = _reduce(first, flat)
        return [total if op != "reduce" or m == root else flat[m] for m in range(n)]
    if op in ("allgather", "allgather_into_tensor"):
        _same_sizes(calls, "inputs")
        return [torch.cat(flat) for _ in range(n)]
    if op == "gather":
        return [torch.cat(flat) if m == root else flat[m][:0] for m in range(n)]
    if op == "scatter":
        chunks = inputs[root]
        if len(chunks) != n:
            raise Refused(f"scatter's root gave {len(chunks)} tensors for a group of {n}")
        return [chunks[m] for m in range(n)]
    if op in ("reduce_scatter", "reduce_scatter_tensor"):
        _same_sizes(calls, "inputs")
        total, start, out = _reduce(first, flat), 0, []
        for call in calls:
            size = sum(call["outputs"])
            out.append(total[start : start + size])
            start += size
        if start != total.numel():
            raise Refused(f"reduce_scatter's outputs hold {start} elements in all, its inputs {total.numel()}")
        return out
    # all-to-all: member m's chunk j goes to member j
    chunks = [inputs[m] if op == "alltoall" else list(flat[m].split(calls[m].get("in_splits") or [])) for m in range(n)]
    if any(len(c) != n for c in chunks):
        raise Refused(f"{op} needs {n} chunks from each member, got {[len(c) for c in chunks]}")
    return [torch.cat([chunks[j][m] for j in range(n)]) for m in range(n)]


def _same_sizes(calls: list[dict], key: str) -> None:
    sizes = [sum(call[key]) for call in calls]
    if len(set(sizes)) > 1:
        raise Refused(f"the members' {key} hold {sizes} elements: one collective needs the same from each")


def _reduce(call: dict, flat: list[torch.Tensor]) -> torch.Tensor:
    try:
        return reduce_values(flat, call["reduce"])
    except (ValueError, KeyError):  # an op that does not apply to the dtype, or none the oracle knows (PREMUL_SUM)
        raise Refused(f"the relay computes no reduction {call['reduce']!r} of {call['dtype']}") from None


def records(calls: list[dict], phases: list) -> list[dict]:
    """Each member's record of the call, in the audit's shape (harness/rank/recording.py), from what
    it sent the relay."""
    first = calls[0]
    size, group = itemsize(first["dtype"]), first["group"]
    made = []
    for m, call in enumerate(calls):
        splits = None
        if call["op"] == "alltoall":
            splits = [k * size for k in call["inputs"]]
        elif call["op"] == "alltoall_base":
            splits = [k * size for k in call.get("in_splits") or []]
        made.append(
            {
                "op": call["op"],
                "group": list(group),
                "rank": group[m],
                "dtype": call["dtype"],
                "itemsize": size,
                "numel": sum(call["inputs"]),
                "bytes": sum(call["inputs"]) * size,
                "out_numel": sum(call["outputs"]),
                "out_bytes": sum(call["outputs"]) * size,
                "peer": None,
                "root": None if call["root"] is None else group[call["root"]],
                "reduce_op": call["reduce"],
                "splits": splits,
                "tag": None,
                "phase": phases[m],
            }
        )
    return made
