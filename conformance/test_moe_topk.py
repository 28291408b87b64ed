"""Conformance of the mixture-of-experts layer as trained: ``ExpertParallelMoE.from_dense(router,
experts, group, top_k=k, compute_aux_loss=True)``, top-k routing and the load-balancing loss over
the group's whole batch (capability ``moe_topk``), with a capacity (``capacity_factor``: capability
``moe_capacity``) or the router replicated over a sequence-parallel group (``sequence_parallel``:
capability ``moe_sequence_parallel``), against reference/moe_routing.py in float64.

Examples: conformance.examples.MixtureExample (a layout; E = n k experts; each member's own 0-6
tokens, so the all-to-alls carry unequal and empty splits), k = 1 to min(3, E), the aux loss's
weight 0.1 or 1. Each member runs forward, then backward of sum(y * G_r) + weight * .aux_loss. In
the driver, within reference.expert_parallel.atol:

* each member's outputs and input gradients, against one process on every member's tokens (each
  token's output is a function of itself only, so a layer whose results depend on other members'
  tokens fails here: Megatron-Bridge#4635);
* each member's experts' gradients, over every (token, choice) routed to them (pytorch#160285:
  expert gradients n times too large at EP = n, with identical loss curves);
* the members' router gradients summed (the router is replicated: data parallelism sums them)
  against the dense layer's, its aux-loss part included (Megatron-LM#3672: an aux loss averaged
  over the ranks again, the router's gradient 1/n of it);
* the members' aux losses summed against the loss over the group's batch (a member that balances
  its own tokens only is off).

Examples whose tokens have two router logits within 1e-6 around or inside their top k are not
drawn: there rounding decides the routing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import parallelism_conformance.reference.expert_parallel as ep
import parallelism_conformance.reference.moe_routing as ref
from parallelism_conformance.conformance.examples import mixture_examples
from parallelism_conformance.conformance.test_expert_parallel import judge_expert_gradients
from parallelism_conformance.conformance.verdict import Judge

PROGRAM = "expert_parallel:forward_backward_topk"
CAPACITY_FACTORS = (0.5, 1.0, 1.5)


@pytest.mark.capability("moe_topk")
@given(data=st.data())
def test_top_k_routing_and_the_load_balancing_loss_over_the_group(data, ranks, target, reproduce):
    check_trained_moe(data, ranks, target, reproduce, capacity=False)


@pytest.mark.capability("moe_capacity")
@given(data=st.data())
def test_a_capacity_drops_each_members_lowest_gates_and_nothing_else(data, ranks, target, reproduce):
    """capacity_factor c (0.5, 1 or 1.5): each member keeps, per expert, the ceil(c k T_r / E) pairs
    of the largest gate among its own; a dropped pair adds nothing and gets no gradient. Counted on
    the member's own tokens, so its outputs still depend on them only."""
    check_trained_moe(data, ranks, target, reproduce, capacity=True)


@pytest.mark.capability("moe_sequence_parallel")
@given(data=st.data())
def test_a_router_replicated_over_a_sequence_parallel_group_gets_the_whole_gradient(data, ranks, target, reproduce):
    """sequence_parallel=True: the members' tokens are shards of one sequence (tensor parallelism's
    sequence-parallel region, each member routing its own shard) and the router is replicated over
    the group, so its gradient must be the whole sequence's on every member, bitwise the same, or
    the replicas of the router drift apart after the first step (torchtitan#2387, #4054: "loss
    curves look normal")."""
    check_trained_moe(data, ranks, target, reproduce, capacity=False, sequence_parallel=True)


def check_trained_moe(data, ranks, target, reproduce, capacity: bool, sequence_parallel: bool = False) -> None:
    example = data.draw(mixture_examples(target.max_world_size), label="example")
    top_k = data.draw(st.integers(1, min(3, example.num_experts)), label="top_k")
    weight = data.draw(st.sampled_from([0.1, 1.0]), label="aux loss weight")
    factor = data.draw(st.sampled_from(CAPACITY_FACTORS), label="capacity_factor") if capacity else None
    t = example.tensors()
    assume(ref.topk_gap(torch.cat(t["xs"]), t["router"], top_k) > ep.ROUTING_TIE)
    assume(ref.capacity_gap(t["xs"], t["router"], top_k, factor) > ep.ROUTING_TIE)
    judge = Judge(f"{example}, top_k={top_k}, aux loss weight {weight}" + (f", capacity_factor={factor}" if capacity else ""), reproduce)
    judge_trained_moe(judge, ranks, example, top_k, weight, factor, sequence_parallel)


def judge_trained_moe(judge: Judge, ranks, example, top_k: int, weight: float, factor: float | None, sequence_parallel: bool) -> None:
    """One forward and backward of ``example`` on the ranks with top-k routing, the aux loss at
    ``weight`` and, unless None, capacity ``factor``, judged against reference/moe_routing.py."""
    t, capacity = example.tensors(), factor is not None
    n, each = example.layout.size, example.experts_per_rank
    expected = ref.moe(t["xs"], t["router"], t["experts"], t["grads"], top_k, weight, factor)
    options = {
        "top_k": top_k,
        "aux_weight": weight,
        **({"capacity_factor": factor} if capacity else {}),
        **({"sequence_parallel": True} if sequence_parallel else {}),
    }
    outputs = judge.run(
        ranks,
        example.layout,
        PROGRAM,
        [{"router_weight": t["router"], "experts": t["experts"], "x": t["xs"][i], "grad_output": t["grads"][i], **options} for i in range(n)],
    )
    for i, rank in enumerate(example.layout.ranks):
        got, where = outputs[rank], f"rank {rank} (group rank {i})"
        for key, want, note in (
            (
                "output",
                expected["outputs"][i],
                f"its own tokens, each through its {top_k} experts" + (", the pairs beyond its capacity dropped" if capacity else ""),
            ),
            ("grad_input", expected["grad_inputs"][i], "dL/dx of its own tokens"),
        ):
            judge.tensor(got[key], want, atol=ep.atol(want), what=f"{where} {key.replace('_', ' ')} ({note})")
        judge_expert_gradients(
            judge,
            where,
            got["grad_experts"],
            expected["grad_experts"],
            i,
            each,
            "summed over every token and choice routed to it from every member" + (", the dropped ones left out" if capacity else ""),
        )
    members = [outputs[rank] for rank in example.layout.ranks]
    if sequence_parallel:  # reduced by the layer: whole on every member
        for rank in example.layout.ranks:
            judge.tensor(
                outputs[rank]["grad_router"],
                expected["grad_router"],
                atol=ep.atol(expected["grad_router"]),
                what=f"rank {rank} router gradient (replicated over the sequence-parallel group: the whole "
                f"sequence's, plus {weight} times the load-balancing loss's, on every member)",
            )
        judge.bitwise_identical(
            {rank: outputs[rank]["grad_router"] for rank in example.layout.ranks}, what="the router's gradient (replicated over the group)"
        )
    router = torch.stack([got["grad_router"].to(torch.float64) for got in members]).sum(0)
    if not sequence_parallel:
        judge.tensor(
            router,
            expected["grad_router"],
            atol=ep.atol(expected["grad_router"]),
            what="the members' router gradients summed (the replicated router: its gradient over every "
            f"member's tokens, plus {weight} times the load-balancing loss's over the group's batch)",
        )
    aux = torch.stack([torch.as_tensor(got["aux_loss"], dtype=torch.float64).reshape(()) for got in members]).sum()
    judge.tensor(
        aux,
        expected["aux_loss"],
        atol=ep.atol(expected["aux_loss"]),
        what="the members' aux_loss summed (E sum_j f_j P_j over the group's whole batch)",
    )
