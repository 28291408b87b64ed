"""The communication half of ``--parallelize``'s cost (issue 57, item 4): each step's bytes per mesh
dimension, as the driver's relay carried them (harness/driver/relay.py: records the driver made as
it carried each call, never the rank's), against what the parameters' placements imply on the
data-parallel dimensions.

Charged. A record of the plan's phases ("forward", "backward", "step": the rank program labels the
plan's application and its own gathers apart, harness/rank/programs/parallelize.py) is charged
(harness/driver/audit.py: ``charged_bytes``, the theory's bytes for a backend collective, a send's
own) to the mesh dimensions its group spans from the rank (the coordinates along which its members
differ; the mesh is row-major over dp_replicate, dp_shard, tp, as init_device_mesh lays it out): a
group along dp_shard is ``dp_shard``'s, a flattened data-parallel group ``dp_replicate+dp_shard``'s.
A collective of integers or booleans is bookkeeping, not charged, as the audit has it (torch's DDP
broadcasts its rebuilt bucket order in the second step's forward: 92 B of int32 here).

Implied, per step and rank, summed over the parameters, for a data-parallel key K (one or both of
dp_replicate and dp_shard), with claim = the parameter's largest local shard in elements
(reference/parallelize.py: ``claimed_bytes``) and reference/cost_model.py's ring formulas:

* K = dp_shard, a parameter sharded on dp_shard (FSDP): its all-gather before forward, again before
  backward where it was resharded, and its gradient's reduce-scatter, of the tensor unsharded over
  dp_shard (n claim, which covers FSDP's padding to a multiple of n):
  2 all_gather(n, n claim) + reduce_scatter(n, n claim);
* a parameter sharded along no dimension of K (DDP, HSDP's replicas): its gradient's all-reduce over
  K: all_reduce(|K|, claim);

and no slack: a ring phase over numel items sends (numel - floor(numel / n)) of them, so several
parameters in one call (a DDP bucket, FSDP's flat buffer) never cost more than each alone, and
n claim is FSDP's padded size exactly. tp is measured and shown, not bounded: its
traffic is the activations' of the model under the plan (docs/parallelize.md, "What is not judged").

Verdict: a key above its bound on any rank is *costs more*, the ratio said beside a pass (the test's
costs-more findings), a failure only under ``--require-bounds yes``."""

from __future__ import annotations

import itertools

from parallelism_conformance.harness.driver.audit import charged_bytes
from parallelism_conformance.reference import cost_model
from parallelism_conformance.reference.parallelize import claimed_bytes

ORDER = ("dp_replicate", "dp_shard", "tp")  # init_device_mesh's row-major order (conformance/parallelize_draws.py: DIMS)
DATA_PARALLEL = ("dp_replicate", "dp_shard")
PLAN_PHASES = ("forward", "backward", "step")
SHARDS = ("Shard", "_StridedShard")
BOOKKEEPING = ("int", "uint", "bool")  # dtype names of collectives that carry no parameter or gradient


def coordinates(rank: int, sizes: dict) -> dict:
    found, rest = {}, rank
    for name in reversed(ORDER):
        found[name], rest = rest % sizes[name], rest // sizes[name]
    return found


def key_of(rank: int, members: list[int], sizes: dict) -> str:
    """The mesh dimensions along which ``members`` differ from ``rank``, joined by '+' ('' for none)."""
    mine = coordinates(rank, sizes)
    spanned = {d for member in members for d, c in coordinates(member, sizes).items() if c != mine[d]}
    return "+".join(d for d in ORDER if d in spanned)


def traffic(records_by_rank: dict, sizes: dict) -> dict[int, dict[str, int]]:
    """{rank: {key: bytes charged}} of the plan's phases."""
    found = {}
    for rank, records in records_by_rank.items():
        totals: dict[str, int] = {}
        for record in records:
            if record.get("phase") not in PLAN_PHASES or record["op"] in ("recv", "recv_anysource", "barrier"):
                continue
            if (record.get("dtype") or "float").startswith(BOOKKEEPING):
                continue
            members = [record["peer"]] if record["op"] == "send" else record["group"]
            key = key_of(rank, members, sizes)
            totals[key] = totals.get(key, 0) + charged_bytes(record)
        found[rank] = totals
    return found


def implied(params: dict, sizes: dict) -> dict[str, int]:
    """{data-parallel key: bytes a rank sends per step}, from rank 0's parameter records (``held``)."""
    dims = [d for d in DATA_PARALLEL if sizes[d] > 1]
    keys = ["+".join(c) for k in range(1, len(dims) + 1) for c in itertools.combinations(dims, k)]
    bounds = dict.fromkeys(keys, 0)
    for record in params.values():
        itemsize = record["itemsize"]
        claim = claimed_bytes(record["shape"], itemsize, record["placements"], record["sizes"]) // itemsize
        sharded = {d for d, p in record["placements"].items() if p.startswith(SHARDS)}
        for key in keys:
            members = key.split("+")
            n = 1
            for d in members:
                n *= sizes[d]
            if key == "dp_shard" and "dp_shard" in sharded:
                bound = 2 * cost_model.all_gather(n, n * claim, itemsize) + cost_model.reduce_scatter(n, n * claim, itemsize)
            elif not sharded & set(members):
                bound = cost_model.all_reduce(n, claim, itemsize)
            else:
                continue
            bounds[key] += bound
    return bounds


def findings(relayed_records: dict, params: dict, sizes: dict, steps: int) -> tuple[float, dict, str | None]:
    """(the largest ratio of a data-parallel key's bytes to its bound, {key: largest bytes of any
    rank per step}, the finding where a ratio is above 1, else None)."""
    carried = traffic(relayed_records, sizes)
    bounds = {key: steps * bound for key, bound in implied(params, sizes).items()}
    worst, finding, shown = 0.0, None, {}
    for rank in sorted(carried):
        for key, sent in carried[rank].items():
            shown[key] = max(shown.get(key, 0), sent // steps)
            bound = bounds.get(key)
            if bound is None:  # tp, or a group along no data-parallel dimension alone: shown, not bounded
                continue
            ratio = sent / bound if bound else float("inf")
            worst = max(worst, ratio)
            if sent > bound and (finding is None or ratio > finding[0]):
                what = f"{bound} B" if bound else "nothing: no parameter is reduced or gathered along it"
                finding = (
                    ratio,
                    f"traffic: rank {rank} sent {sent} B along {key} in {steps} step(s), {ratio:.3g}x what its placements imply ({what})",
                )
    return worst, shown, None if finding is None else finding[1]


def describe(shown: dict, steps: int) -> str:
    """'dp_shard: 1234 B, tp: 456 B per step (the largest rank's)'."""
    if not shown:
        return "no communication in the plan's phases"
    moved = {key: sent for key, sent in sorted(shown.items()) if key and sent}
    if not moved:
        return "no communication in the plan's phases"
    return ", ".join(f"{key}: {sent} B" for key, sent in moved.items()) + " per step (the largest rank's)"
