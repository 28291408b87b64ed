"""The communication audit's driver-side parts without any rank: the cost model's bounds against
the algorithms they describe, and each rule of harness/driver/audit.py on hand-made records."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parallelism_conformance.conformance.audit.collective_calls import collective_case
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.harness.driver import audit
from parallelism_conformance.reference import cost_model
from parallelism_conformance.reference.collectives import DTYPES


def record(op, rank=0, group=(0, 1), numel=10, itemsize=4, out_numel=None, peer=None, root=None, dtype="float32", splits=None, phase=None):
    out_numel = numel if out_numel is None else out_numel
    return {
        "op": op,
        "group": list(group),
        "rank": rank,
        "dtype": dtype,
        "itemsize": itemsize,
        "numel": numel,
        "bytes": numel * itemsize,
        "out_numel": out_numel,
        "out_bytes": out_numel * itemsize,
        "peer": peer,
        "root": root,
        "reduce_op": None,
        "splits": splits,
        "tag": 0,
        "phase": phase,
    }


# ----------------------------------------------------------------------------------- cost model
@given(n=st.integers(1, 9), numel=st.integers(0, 5000))
def test_ring_all_reduce_bound_covers_every_rank_of_the_ring(n, numel):
    """impls' ring: chunks of tensor_split sizes; rank i sends every chunk but i (reduce-scatter) and
    every chunk but i+1 (all-gather). The bound holds for every rank, the worst rank is within one
    item of it, and it is within two items of 2(n-1)/n S."""
    q, r = divmod(numel, n)
    chunks = [q + 1] * r + [q] * (n - r)
    sent = [(numel - chunks[i]) + (numel - chunks[(i + 1) % n]) if n > 1 else 0 for i in range(n)]
    bound = cost_model.all_reduce(n, numel, 1)
    assert bound - 1 <= max(sent) <= bound or n == 1
    assert 2 * (n - 1) / n * numel <= bound < 2 * (n - 1) / n * numel + 2


@given(n=st.integers(1, 40))
def test_binomial_broadcast_root_sends_ceil_log2_n_times(n):
    children = sum(1 for k in range(n.bit_length()) if 2**k < n)  # the root sends to 1, 2, 4, ... < n
    assert cost_model.broadcast(n, 1, 1) == children == (math.ceil(math.log2(n)) if n > 1 else 0)


@given(n=st.integers(2, 8), numels=st.lists(st.integers(1, 300), min_size=1, max_size=8), data=st.data())
def test_data_parallel_bound_covers_any_bucketing(n, numels, data):
    cuts = sorted(data.draw(st.sets(st.integers(1, len(numels) - 1), max_size=len(numels) - 1))) if len(numels) > 1 else []
    buckets = [sum(numels[a:b]) for a, b in zip([0, *cuts], [*cuts, len(numels)])]
    sent = sum(cost_model.all_reduce(n, m, 4) for m in buckets)
    assert sent <= cost_model.data_parallel_step(n, numels, 4)
    assert cost_model.data_parallel_step(n, numels, 4) < 2 * (n - 1) / n * 4 * (sum(numels) + len(numels)) + 4


def test_training_budgets():
    assert cost_model.tensor_parallel_mlp(4, 100, 4) == {"forward": 600, "backward": 600}
    assert cost_model.column_parallel(4, 100, 4) == {"forward": 0, "backward": 600}
    # all-gather + reduce-scatter of 100 items over 4 ranks: 75 + 75 items; backward + dL/db2 (8 items: 12)
    assert cost_model.sequence_parallel_mlp(4, 100, 8, 4) == {"forward": 600, "backward": 648}


def test_expert_parallel_moves_only_the_tokens_that_leave_and_their_results():
    routed = [[2, 3], [4, 1]]  # rank 0 keeps 2 tokens, sends 3 to rank 1, gets 4 from it
    budget = cost_model.expert_parallel_moe(routed, 0, hidden=5, itemsize=8, num_experts=4)
    assert budget == {"forward": 1 * 4 * 8 + (3 + 4) * 5 * 8, "backward": (3 + 4) * 5 * 8}


def test_zero_stage_1_moves_data_parallel_volume_up_to_the_shard_balance():
    # LPT: 5 | 4 | 3+2 -> the fullest shard holds 5 items
    assert cost_model.balanced_shard([5, 4, 3, 2], 3) == 5
    assert cost_model.balanced_shard([8] * 8, 4) == 16
    assert cost_model.sharded_optimizer_step(4, [8] * 8, 4) == 2 * 3 * 16 * 4 == cost_model.all_reduce(4, 64, 4)
    assert cost_model.sharded_optimizer_step(1, [3, 2], 4) == 0
    assert cost_model.pipeline_stage(3, 0, 4, 10) == {"forward": 40, "backward": 0}
    assert cost_model.pipeline_stage(3, 2, 4, 10) == {"forward": 0, "backward": 40}
    assert cost_model.all_to_all([4, 8, 12], me=1) == 16
    with pytest.raises(ValueError, match="no cost model"):
        cost_model.collective("all_reduce_twice", 2, 0, numel=1, itemsize=1)


# ---------------------------------------------------------------------------------------- rules
def test_point_to_point_rule_names_the_backend_collective():
    records = {0: [record("send", peer=1), record("recv", peer=1)], 1: [record("allreduce", rank=1)]}
    violations = audit.point_to_point_only(records)
    assert len(violations) == 1 and violations[0].startswith("rank 1: 1 backend collective call(s) (allreduce x1)")


def test_bound_rule_charges_sends_exactly_and_backend_collectives_by_theory():
    assert audit.charged_bytes(record("send", numel=7)) == 28
    assert audit.charged_bytes(record("recv", numel=7)) == 0
    assert audit.charged_bytes(record("allreduce", group=(0, 1, 2, 3), numel=10)) == cost_model.all_reduce(4, 10, 4)
    assert audit.charged_bytes(record("allgather_into_tensor", numel=5, out_numel=10)) == 20
    assert audit.charged_bytes(record("alltoall_base", rank=1, splits=[8, 4])) == 8
    records = {0: [record("send", numel=10)] * 2, 1: [record("send", rank=1, numel=10)]}
    violations = audit.within_bound(records, {0: 40, 1: 40}, "x")
    assert violations == [violations[0]] and violations[0].startswith("rank 0: sent 80 B, more than the bound 40 B (2.00x)")
    assert audit.within_bound({2: [record("send", rank=2)]}, {}, "x")[0].startswith("rank 2: sent 40 B where x sends nothing")


def test_bound_rule_looks_at_one_phase():
    records = {0: [record("send", numel=100, phase="setup"), record("send", numel=10, phase="step")]}
    assert audit.within_bound(records, {0: 40}, "x", phase="step") == []
    assert audit.within_bound(records, {0: 40}, "x") != []


def test_reduced_once_rule():
    once = {0: [record("allreduce", numel=100), record("allreduce", numel=3, dtype="int32")]}
    assert audit.reduced_once(once, 400, "g") == []
    twice = {0: [record("allreduce", numel=100), record("allreduce", numel=100)]}
    assert "reduced 800 B" in audit.reduced_once(twice, 400, "g")[0]
    assert audit.reduced_once({0: [record("send", numel=100)]}, 400, "g") == []  # point-to-point: left to the bound


def test_no_full_all_gather_rule():
    records = {0: [record("allgather_into_tensor", numel=8, out_numel=16)]}
    assert audit.no_full_all_gather(records, 64, "hidden") != []
    assert audit.no_full_all_gather(records, 128, "hidden") == []


# ------------------------------------------------------------------ buckets, overlap, accounting
def test_a_bucket_may_pass_the_cap_only_by_the_parameter_that_closes_it():
    sizes = [352, 256, 384, 48, 384, 32]  # tied_lm's trainable gradients, bytes, registration order
    allowed = audit.bucket_sizes_allowed(sizes, 256)
    assert {352, 256, 384, 48 + 384, 384 + 32} <= allowed  # one parameter, or a small one and the one that closes
    assert sum(sizes) not in allowed and 352 + 256 + 384 not in allowed
    one = {0: [record("allreduce", numel=sum(sizes) // 4, phase="finish")]}
    assert audit.buckets_within_cap(one, 256, sizes)[0].startswith("rank 0: 1 reduction(s) that are not a bucket")
    fine = {0: [record("allreduce", numel=(48 + 384) // 4, phase="backward")]}
    assert audit.buckets_within_cap(fine, 256, sizes) == []


def test_overlap_needs_communication_before_backward_ends():
    deferred = {
        0: [record("allreduce", phase="finish")],
        1: [record("send", phase="backward", peer=0)],
        2: [record("allreduce", phase="last_gradient")],
    }  # every bucket launched by the last gradient's hook
    violations = audit.starts_during_backward(deferred, "why")
    assert len(violations) == 2
    assert violations[0].startswith("rank 0: no communication started while backward still computed gradients")
    assert violations[1].startswith(
        "rank 2: no communication started while backward still computed gradients (1 call(s) launched at the last gradient"
    )


def test_bytes_the_kernel_counted_beyond_the_records_are_reported():
    records = {0: [record("send", numel=1000, peer=1)], 1: []}
    assert audit.accounted(records, {0: 4000 + 200, 1: 900}) == []  # payload + overhead; idle rank under the floor
    violations = audit.accounted(records, {0: 4000 + 200 + 8000, 1: 4096})
    assert [v.split(":")[0] for v in violations] == ["rank 0", "rank 1"]
    assert "communication that went around the recorder" in violations[1]


def test_bytes_are_attributed_to_link_classes_and_a_tp_group_across_hosts_is_named():
    from parallelism_conformance.reference.topology import ACROSS, WITHIN, HostLayout

    layout = HostLayout.parse("2x4")
    assert layout.host_of(3) == 0 and layout.host_of(4) == 1 and layout.link(1, 5) == ACROSS
    records = {0: [record("send", numel=10, peer=1), record("send", numel=5, peer=4), record("allreduce", group=(0, 4), numel=8)]}
    by_link = audit.bytes_by_link(records, layout)
    assert by_link[0] == {WITHIN: 40, ACROSS: 20 + cost_model.all_reduce(2, 8, 4)}
    violations = audit.groups_within_hosts([[0, 1, 2, 3], [0, 4]], layout, "tensor-parallel")
    assert violations == [
        "tensor-parallel group [0, 4] spans hosts [0, 1] on 2 hosts x 4 ranks, though 2 ranks fit "
        "on one host: it belongs on the fast links within a host"
    ]
    assert audit.groups_within_hosts([list(range(8))], layout, "tensor-parallel") == []  # cannot fit one host
    with pytest.raises(ValueError, match="HOSTSxRANKS_PER_HOST"):
        HostLayout.parse("2-4")


@given(data=st.data(), name=st.sampled_from(["all_reduce", "all_to_all", "broadcast"]))
def test_the_audit_never_draws_what_the_backend_refuses(data, name):
    """Measured on torch 2.11 (an H200 runner's image): gloo refuses all_to_all for every dtype, and
    the audit drew it anyway, failing torch.distributed. The audit draws as test_collectives does:
    refused dtypes are never drawn, and a collective refused for every dtype is skipped with why."""
    draw = lambda label, strategy: data.draw(strategy, label=label)
    refused = frozenset({torch.int64, torch.float64})
    _, args, _, _ = collective_case(name, draw, Layout(2), refused_for=lambda n, op: refused if n == name else frozenset())
    values = [v for a in args for v in a.values()]
    drawn = {t.dtype for v in values for t in (v if isinstance(v, list) else [v]) if isinstance(t, torch.Tensor)}
    assert drawn and not drawn & refused
    with pytest.raises(pytest.skip.Exception, match=f"refuses {name}"):
        collective_case(name, draw, Layout(2), refused_for=lambda n, op: frozenset(DTYPES))


def test_bytes_are_charged_to_the_mesh_axis_they_travel_along_and_the_link_they_cross():
    """pp=2 x tp=2 on 2 hosts of 2 (reference.mesh.Mesh): rank 0's tensor-parallel peer is 1 (same
    host), its pipeline peer 2 (other host); a send to 3 belongs to no axis of rank 0; a backend
    all-reduce on exactly the tensor-parallel group is tensor-parallel traffic."""
    from parallelism_conformance.reference.mesh import Mesh
    from parallelism_conformance.reference.topology import ACROSS, WITHIN, HostLayout

    grid, layout = Mesh(2, 1, 2), HostLayout(2, 2)
    axes = {axis: grid.groups(axis) for axis in ("tp", "pp", "dp")}
    records = {
        0: [
            record("send", peer=1, numel=3, group=(0, 1, 2, 3)),
            record("send", peer=2, numel=5, group=(0, 2)),
            record("send", peer=3, numel=7, group=(0, 1, 2, 3)),
            record("allreduce", group=(0, 1), numel=8),
            record("recv", peer=2, numel=100, group=(0, 2)),
        ]
    }
    by_axis = audit.bytes_by_axis(records, layout, axes)
    assert by_axis[0]["tp"] == {WITHIN: 3 * 4 + cost_model.all_reduce(2, 8, 4), ACROSS: 0}
    assert by_axis[0]["pp"] == {WITHIN: 0, ACROSS: 20}
    assert by_axis[0]["other"] == {WITHIN: 0, ACROSS: 28} and by_axis[0]["dp"] == {WITHIN: 0, ACROSS: 0}
    assert audit.link_report(by_axis) == (
        f"tp: {12 + cost_model.all_reduce(2, 8, 4)} B {WITHIN}, 0 B {ACROSS}; "
        f"pp: 0 B {WITHIN}, 20 B {ACROSS}; dp: 0 B {WITHIN}, 0 B {ACROSS}; "
        f"other: 0 B {WITHIN}, 28 B {ACROSS}"
    )


def test_a_mesh_lays_out_pp_outermost_and_tp_innermost():
    from parallelism_conformance.reference.mesh import Mesh, data_parallel_groups, pipeline_mesh, tensor_parallel_groups

    grid = Mesh(2, 2, 2)
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [grid.coordinates(r) for r in (0, 5, 7)] == [(0, 0, 0), (1, 0, 1), (1, 1, 1)]
    assert all(grid.rank(*grid.coordinates(r)) == r for r in range(8))
    assert Mesh(3, 2, 1).groups("pp") == pipeline_mesh(3, 2)[0] and Mesh(3, 2, 1).groups("dp") == pipeline_mesh(3, 2)[1]
    assert Mesh(1, 3, 2).groups("tp") == tensor_parallel_groups(3, 2)
    assert Mesh(1, 3, 2).groups("dp") == data_parallel_groups(3, 2)


def test_a_round_robin_placement_deals_ranks_out_to_hosts_in_turn():
    from parallelism_conformance.reference.topology import ACROSS, WITHIN, HostLayout

    blocked, dealt = HostLayout(2, 2), HostLayout(2, 2, round_robin=True)
    assert [blocked.host_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [dealt.host_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert blocked.link(0, 1) == WITHIN and dealt.link(0, 1) == ACROSS and dealt.link(0, 2) == WITHIN
