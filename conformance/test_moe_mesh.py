"""Conformance of expert parallelism inside data parallelism (capability ``moe_mesh``): a dp x ep mesh,
rank d ep + e the e-th member of replica d's expert-parallel group (expert parallelism innermost, as
tensor parallelism is), every rank with tokens of its own. The implementation's
``ExpertParallelMoE`` runs on each expert-parallel group; the harness then makes the reductions a
trainer makes with the implementation's ``all_reduce``: each expert's gradients summed over its
data-parallel group (the ranks holding the same experts), the router's over the world
(harness/rank/programs/expert_parallel.py, ``mesh_step``). The judge is one process running the whole
layer over every rank's tokens (reference/expert_parallel.py).

Reported bugs this is for: pytorch#160285 (expert gradients 2x at EP = 2 with identical loss curves:
a layer that reduces its experts' gradients over more ranks than hold them), and the group mix-ups
of any composition: experts picked, or tokens exchanged, by global rank or over the default group,
which a layer spanning the world never shows.

Each test draws dp and ep (2 to --max-world-size ranks), E = ep k experts, h, f, each rank's own
number of tokens (0-4) and seeds, float64. In the driver, rank by rank, within
reference.expert_parallel.atol: the output and input gradient of its own tokens; its E/ep experts'
gradients summed over every token of the world routed to them; the router's gradient over every
token of the world.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import parallelism_conformance.reference.expert_parallel as ref
from parallelism_conformance.conformance.examples import Layout, MixtureExample
from parallelism_conformance.conformance.test_expert_parallel import judge_expert_gradients
from parallelism_conformance.conformance.verdict import Judge

PROGRAM = "expert_parallel:mesh_step"


def mesh_shapes(max_world_size: int) -> list[tuple[int, int]]:
    """(dp, ep) with 2 <= dp ep <= max_world_size, smallest worlds first."""
    found = [(dp, ep) for dp in range(1, max_world_size + 1) for ep in range(1, max_world_size + 1) if 2 <= dp * ep <= max_world_size]
    return sorted(found, key=lambda shape: (shape[0] * shape[1], shape))


@pytest.mark.capability("moe_mesh")
@given(data=st.data())
def test_expert_parallel_inside_data_parallel_matches_one_process(data, ranks, target, reproduce):
    check_mesh(data, ranks, target, reproduce, sequence_parallel=False)


@pytest.mark.capability("moe_tp_mesh")
@given(data=st.data())
def test_expert_parallel_on_the_tensor_parallel_group_inside_data_parallel(data, ranks, target, reproduce):
    """The expert-parallel group is a tensor-parallel group (torchtitan borrows TP's ranks for EP):
    its members' tokens are shards of one sequence and the layer, built with
    sequence_parallel=True, reduces the replicated router's gradient over that group itself; the
    trainer sums it over the data-parallel group only. A layer that reduces it over the world, or
    not at all (torchtitan#4054: TP without EP skipped an all-reduce), fails."""
    check_mesh(data, ranks, target, reproduce, sequence_parallel=True)


def check_mesh(data, ranks, target, reproduce, sequence_parallel: bool) -> None:
    shapes = mesh_shapes(min(target.max_world_size, 4))
    if not shapes:
        pytest.skip(f"needs a world of at least 2 ranks; this run draws at most {target.max_world_size}")
    dp, ep = data.draw(st.sampled_from(shapes), label="mesh (dp, ep)")
    world = dp * ep
    example = MixtureExample(
        layout=Layout(ep),
        experts_per_rank=data.draw(st.integers(1, 2), label="experts per rank"),
        h=data.draw(st.integers(1, 4), label="h"),
        f=data.draw(st.integers(1, 4), label="f"),
        tokens=tuple(data.draw(st.lists(st.integers(0, 4), min_size=world, max_size=world), label="tokens per rank")),
        seed=data.draw(st.integers(0, 2**16), label="seed"),
    )
    t = example.tensors()
    tokens = torch.cat(t["xs"])
    assume(tokens.shape[0] == 0 or ref.top2_gap(tokens, t["router"]) > ref.ROUTING_TIE)
    groups = {"ep": [[d * ep + e for e in range(ep)] for d in range(dp)], "dp": [[d * ep + e for d in range(dp)] for e in range(ep)]}
    judge = Judge(
        f"mesh dp={dp} x ep={ep} (rank d ep + e), {example}"
        + (", sequence_parallel=True (ep is the tensor-parallel group)" if sequence_parallel else ""),
        reproduce,
    )
    expected = ref.moe(t["xs"], t["router"], t["experts"], t["grads"])
    outputs = judge.run(
        ranks,
        Layout(world),
        PROGRAM,
        [
            {
                "router_weight": t["router"],
                "experts": t["experts"],
                "x": t["xs"][r],
                "grad_output": t["grads"][r],
                "mesh": groups,
                **({"sequence_parallel": True} if sequence_parallel else {}),
            }
            for r in range(world)
        ],
    )
    router = sum(expected["grad_router"][1:], expected["grad_router"][0])
    for rank in range(world):
        d, e = divmod(rank, ep)
        got, where = outputs[rank], f"rank {rank} (replica {d}, expert-parallel member {e})"
        for key, want, note in (
            ("output", expected["outputs"][rank], "its own tokens"),
            ("grad_input", expected["grad_inputs"][rank], "dL/dx of its own tokens"),
            (
                "grad_router",
                router,
                "over the world: every rank's tokens"
                + (", reduced over its tensor-parallel group by the layer, then over the data-parallel group" if sequence_parallel else ""),
            ),
        ):
            judge.tensor(got[key], want, atol=ref.atol(want), what=f"{where} {key.replace('_', ' ')} ({note})")
        judge_expert_gradients(
            judge,
            where,
            got["grad_experts"],
            expected["grad_experts"],
            e,
            example.experts_per_rank,
            f"summed over data-parallel group {groups['dp'][e]}: every token of the world routed to it",
        )
    if sequence_parallel:
        judge.bitwise_identical(
            {rank: outputs[rank]["grad_router"] for rank in range(world)},
            what="the router's gradient (replicated over the whole mesh once summed)",
        )
