"""The fixed cases of test_collectives.py, one deterministic example each where a drawn one may
never reach what they check: a root named by global rank in a group not starting at 0, what the
backend's own collectives refuse, and messages well above the sizes Hypothesis draws."""

from __future__ import annotations

import pytest
import torch

import parallelism_conformance.reference.collectives as ref
from parallelism_conformance.conformance.collective_table import TABLE, Case, judge_results
from parallelism_conformance.conformance.examples import Layout, Values, sentinel
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.reference.tolerance import reduction_atol

# A group whose members are not 0..k-1, its root named by global rank: src/dst are global ranks
# (torch.distributed's), and an implementation that reads them as group ranks is right only where
# the two coincide, which a drawn layout may never reach in a run's examples
ROOTED_IN_A_GROUP = Layout(4, (1, 2, 3))
GROUP_ROOT = 2  # global rank 2 is group rank 1; read as group rank 2 it names global rank 3


def judge_root_in_a_group(collective: str, ranks, reproduce) -> None:
    """scatter or gather on ROOTED_IN_A_GROUP with its root GROUP_ROOT, judged by the reference."""
    layout, root = ROOTED_IN_A_GROUP, GROUP_ROOT
    judge = Judge(f"{layout}, {'src' if collective == 'scatter' else 'dst'}={root} (group rank {layout.ranks.index(root)})", reproduce)
    pieces = [torch.arange(3, dtype=torch.float32) + 10 * i for i in range(layout.size)]
    if collective == "scatter":
        sent = [pieces if rank == root else None for rank in layout.ranks]
        outputs = judge.call(ranks, layout, "scatter", [{"tensor": sentinel(pieces[0]), "scatter_list": s, "src": root} for s in sent])
        expected = ref.scatter(pieces, layout.ranks.index(root), layout.size)
        for i, rank in enumerate(layout.ranks):
            judge.tensor(outputs[rank]["tensor"], expected[i], what=f"rank {rank} output")
    else:
        arguments = [
            {"tensor": x, "gather_list": [sentinel(x) for _ in pieces] if rank == root else None, "dst": root}
            for rank, x in zip(layout.ranks, pieces)
        ]
        outputs = judge.call(ranks, layout, "gather", arguments)
        expected = ref.gather(pieces, layout.ranks.index(root))[layout.ranks.index(root)]
        judge.tensors(outputs[root]["gather_list"], expected, what=f"dst rank {root} gather_list")


def judge_backend_refusals(collective: str, ranks, target, backend_refusals, request, reproduce) -> None:
    """test_cases_the_backend_refuses: raising on a case the backend refuses is allowed; a result must be right."""
    cases = backend_refusals.cases(collective)
    if not cases:
        pytest.skip(f"the {backend_refusals.backend} backend accepts every dtype and op of {collective}")
    layout = Layout(min(3, target.max_world_size))
    n = layout.size
    collective_entry = TABLE[collective.removesuffix("_uneven")]
    declined = []
    for dtype_name, op, message in cases:
        vals = Values(getattr(torch, dtype_name), (2 * n,), seed=7, op=op)
        # uneven: member i sends i + 1 elements to every member
        inputs = [vals.tensor(i, ((i + 1) * n,) if collective == "all_to_all_uneven" else None) for i in range(n)]
        judge = Judge(f"{layout}, {vals} op={op}", reproduce)
        try:
            outputs = judge.call(ranks, layout, collective_entry.name, collective_entry.call(inputs, Case(op=op)))
        except Exception:  # noqa: BLE001 - raising on what the backend refuses is allowed (a crash, a hang
            # or a missing function is not: those are BaseExceptions here, and fail the test)
            declined.append((f"{dtype_name} {op or ''}".strip(), message))
            continue
        judge_results(judge, outputs, collective_entry, collective_entry.expected(inputs, Case(op=op)), layout.ranks, 0)
    if declined:  # allowed by the contract, so it passes: the maximum never depends on what a rank did
        by_message: dict[str, list[str]] = {}
        for case, message in declined:
            by_message.setdefault(message.split(" to the desired")[0], []).append(case)
        request.node.user_properties.append(
            (
                "note",
                f"declines what {backend_refusals.backend} refuses: "
                + "; ".join(f"{', '.join(cases)} ({message})" for message, cases in by_message.items()),
            )
        )


LARGE_WORLD = 3  # odd, so chunks of n-th parts are uneven in general
LARGE_NUMEL = 15 * 2**18 + 7  # 15 MiB of float32 and an odd remainder: n-th parts over 4 MiB


def large_inputs(n: int, numel: int) -> list[torch.Tensor]:
    """Small integers as float32 (sums of a few are exact), a different tensor per rank."""
    generator = torch.Generator().manual_seed(numel * 31 + n)
    return [torch.randint(-8, 9, (numel,), generator=generator).to(torch.float32) for _ in range(n)]


def judge_large_message(collective: str, ranks, target, reproduce) -> None:
    """test_large_message: one collective on a message above 15 MiB, its root not rank 0."""
    n = min(LARGE_WORLD, target.max_world_size)
    if n < 2:
        pytest.skip("large messages need a world of 2 or more ranks (--max-world-size)")
    layout = Layout(n)
    numel = {
        "reduce_scatter_tensor": LARGE_NUMEL - LARGE_NUMEL % n,
        "all_to_all_single": LARGE_NUMEL - LARGE_NUMEL % n,
        "all_gather_into_tensor": LARGE_NUMEL // n,
    }.get(collective, LARGE_NUMEL)
    judge = Judge(f"{collective}, world_size={n}, {numel} float32 elements per rank ({numel * 4 / 2**20:.1f} MiB), integer values", reproduce)
    inputs = large_inputs(n, numel)
    root = {"broadcast": n - 1, "reduce": 1}.get(collective, 0)  # not rank 0: a hard-coded root is caught
    entry = TABLE[collective]
    case = Case(root, "SUM")
    outputs = judge.call(ranks, layout, collective, entry.call(inputs, case))
    judge_results(judge, outputs, entry, entry.expected(inputs, case), layout.ranks, root)


def order_sensitive_inputs(n: int, numel: int = 24, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Inputs whose sum depends on the order of addition: in each element one rank holds +big, one
    -big and the rest 1, big = 4 / eps (float32: 2^25, where 2^25 + 1 rounds back to 2^25), the big
    ones on different ranks from element to element, so any order that depends on the rank adding
    changes some element's bits, and the value stays within the reference's tolerance either way."""
    big = 4 / torch.finfo(dtype).eps
    inputs = [torch.ones(numel, dtype=dtype) for _ in range(n)]
    for j in range(numel):
        inputs[j % n][j] = big
        inputs[(j + 1 + (j // n) % (n - 1)) % n][j] = -big
    return inputs


def judge_order_sensitive_sum(n: int, ranks, target, reproduce) -> None:
    """all_reduce SUM on order_sensitive_inputs: right within the reduction's tolerance on every rank,
    and the same bits on every rank (a replicated result); a rank that sums in its own order is
    caught here on every run, where a drawn example catches it only when its values expose it."""
    if n > target.max_world_size:
        pytest.skip(f"needs {n} ranks (--max-world-size {target.max_world_size})")
    layout, inputs = Layout(n), order_sensitive_inputs(n)
    judge = Judge(f"{layout}, 24 float32 elements of +-2^25 and 1 (the sum depends on the order), SUM", reproduce)
    outputs = judge.call(ranks, layout, "all_reduce", [{"tensor": x.clone(), "op": "SUM"} for x in inputs])
    expected = ref.all_reduce(inputs, "SUM")
    for i, rank in enumerate(layout.ranks):
        judge.tensor(outputs[rank]["tensor"], expected[i], what=f"rank {rank} tensor", atol=reduction_atol(inputs, "SUM"))
    judge.bitwise_identical({r: outputs[r]["tensor"] for r in layout.ranks}, what="all_reduce result")
