"""Conformance of expert parallelism (``ExpertParallelMoE.from_dense(router, experts, group=None)``,
the contract in harness/rank/programs/expert_parallel.py), against reference/expert_parallel.py.
Examples: conformance.examples.MixtureExample.

Each test draws an example (a world size, half the time a subgroup of it; E = n k experts of
width h -> f -> h; each member's own number of tokens, 0-6, so the all-to-alls carry unequal
splits and some experts get no token; float64), builds the router, the experts, every member's
tokens and upstream gradient in the driver, and sends each member the dense weights and its own
tokens. The ranks route, exchange, run their experts and return (harness/rank/programs/expert_parallel.py).
In the driver, member by member, within reference.expert_parallel.atol:

* the output and the input gradient of its own tokens equal those of one process running the
  whole layer on every member's tokens (y = p_e E_e(x), top-1 of softmax(x W_r^T));
* its router gradient covers its own tokens (the router is replicated);
* the gradients of its E/n experts (the member's contiguous block) sum over every token routed to
  them from every member; an expert no token reached has zero gradients.

Examples where two router logits of a token are within 1e-6 of each other are not drawn: there
the routing, a discontinuous choice, would be decided by rounding. A number of experts the group
does not divide raises a ValueError naming num_experts, its value and the group size.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import parallelism_conformance.reference.expert_parallel as ref
from parallelism_conformance.conformance.examples import layouts, mixture_examples
from parallelism_conformance.conformance.verdict import Judge

PROGRAM = "expert_parallel:forward_backward"


@pytest.mark.capability("expert_parallel")
@given(data=st.data())
def test_expert_parallel_moe_equals_one_process_with_every_expert(data, ranks, target, reproduce):
    example = data.draw(mixture_examples(target.max_world_size), label="example")
    t = example.tensors()
    assume(ref.top2_gap(torch.cat(t["xs"]), t["router"]) > ref.ROUTING_TIE)
    judge = Judge(str(example), reproduce)
    n, each = example.layout.size, example.experts_per_rank
    expected = ref.moe(t["xs"], t["router"], t["experts"], t["grads"])
    outputs = judge.run(
        ranks,
        example.layout,
        PROGRAM,
        [{"router_weight": t["router"], "experts": t["experts"], "x": t["xs"][i], "grad_output": t["grads"][i]} for i in range(n)],
    )
    for i, rank in enumerate(example.layout.ranks):
        got, where = outputs[rank], f"rank {rank} (group rank {i})"
        for key, want, note in (
            ("output", expected["outputs"][i], "its own tokens"),
            ("grad_input", expected["grad_inputs"][i], "dL/dx of its own tokens"),
            ("grad_router", expected["grad_router"][i], "the replicated router, its own tokens"),
        ):
            judge.tensor(got[key], want, atol=ref.atol(want), what=f"{where} {key.replace('_', ' ')} ({note})")
        judge_expert_gradients(
            judge, where, got["grad_experts"], expected["grad_experts"], i, each, "summed over every token routed to it from every member"
        )


def judge_expert_gradients(judge: Judge, where: str, got, expected: list, member: int, each: int, note: str) -> None:
    """Member ``member``'s E/n experts (its contiguous block) against the dense experts' gradients."""
    if not isinstance(got, list) or len(got) != each:
        judge.fail(f"{where}: .experts holds {len(got) if isinstance(got, list) else got!r} experts, expected E/n = {each}")
    for k, grads in enumerate(got):
        j = member * each + k
        for name, actual, want in zip(("fc1 weight", "fc1 bias", "fc2 weight", "fc2 bias"), grads, expected[j]):
            judge.tensor(actual, want, atol=ref.atol(want), what=f"{where} gradient of expert {j}'s {name} (its local expert {k}; {note})")


@pytest.mark.min_ranks(2)
@pytest.mark.capability("expert_parallel")
@given(data=st.data())
def test_experts_that_do_not_split_are_refused(data, ranks, target, reproduce):
    layout = data.draw(layouts(target.max_world_size, min_size=2), label="layout")
    n = layout.size
    num_experts = data.draw(st.integers(1, 2 * n).filter(lambda e: e % n), label="num_experts")
    router = torch.randn(num_experts, 3, dtype=torch.float64)
    experts = [
        (
            torch.zeros(2, 3, dtype=torch.float64),
            torch.zeros(2, dtype=torch.float64),
            torch.zeros(3, 2, dtype=torch.float64),
            torch.zeros(3, dtype=torch.float64),
        )
    ] * num_experts
    judge = Judge(f"{layout}, num_experts={num_experts}", reproduce)
    outputs = judge.run(ranks, layout, "expert_parallel:refusal", [{"router_weight": router, "experts": experts}] * n)
    for rank in layout.ranks:
        raised, message = outputs[rank]["raised"], outputs[rank]["message"]
        if raised != "ValueError" or not (
            "num_experts" in message and re.search(rf"\b{num_experts}\b", message) and re.search(rf"\b{n}\b", message)
        ):
            judge.fail(
                f"rank {rank}: {num_experts} experts over a group of {n}: expected a ValueError naming "
                f"num_experts, {num_experts} and {n}; got {raised or 'nothing raised'}: {message!r}"
            )
