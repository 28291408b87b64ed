"""One entry per collective, as nccl-tests' ``struct testColl`` has one per operation: how it is
called on the n members of a group from one flat input tensor per member, which argument holds the
result, the reference that result must equal, on which members it is defined, and how many
elements its message has in the cost model's terms (reference/cost_model.py).

Every call of a collective that the suite builds from a case rather than spelling out comes from
here: the cases the backend refuses and the large messages (test_collectives.py), the audit's
calls (conformance/audit/collective_calls.py) and the backend probe (conformance/conftest.py). The
drawn tests of test_collectives.py spell each call out, one per section of torch.distributed's
documentation, with the shapes and lists they draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

import parallelism_conformance.reference.collectives as ref
from parallelism_conformance.conformance.examples import sentinel


def pieces(x: Tensor, n: int) -> list[Tensor]:
    """A member's input cut into n equal flat pieces (row i of an all_to_all, one chunk per peer)."""
    flat, k = x.reshape(-1), x.numel() // n
    return [flat[i * k : (i + 1) * k] for i in range(n)]


@dataclass(frozen=True)
class Case:
    """What a call needs besides the inputs: the root as a member index, the reduction's name,
    all_to_all_single's input splits (rows of member i; None: equal), the members' global ranks."""

    root: int = 0
    op: str | None = None
    splits: list[list[int]] | None = None
    ranks: tuple[int, ...] | None = None  # None: members 0..n-1 of the world

    def root_rank(self) -> int:  # src and dst are global ranks, also in a subgroup
        return self.root if self.ranks is None else self.ranks[self.root]


Builder = Callable[[list[Tensor], Case], list]  # (each member's input, case) -> a list, one per member


@dataclass(frozen=True)
class Collective:
    name: str  # the function of torch.distributed
    result: str  # the argument that holds the result after the call
    call: Builder  # each member's keyword arguments
    expected: Builder  # each member's result as the reference computes it (reference/collectives.py)
    # the message's element count S of reference/cost_model.py, from the input's numel m and n
    message_numel: Callable[[int, int], int]
    root_only: bool = False  # only the root's result is defined (reduce, gather)
    list_result: bool = False  # the result is a list of tensors
    divisible: bool = False  # the input's numel must be a multiple of n (it is cut into n pieces)

    def members_judged(self, n: int, root: int) -> list[int]:
        return [root] if self.root_only else list(range(n))


def _alone(m: int, n: int) -> int:
    return m


def _gathered(m: int, n: int) -> int:
    return n * m


def _piece(m: int, n: int) -> int:
    return m // n


def _reduce_scatter(xs, c):
    return [{"output": sentinel(x, (x.numel() // len(xs),)), "input_list": pieces(x, len(xs)), "op": c.op} for x in xs]


def _scatter(xs, c):
    return [
        {"tensor": sentinel(x, (x.numel() // len(xs),)), "scatter_list": pieces(x, len(xs)) if i == c.root else None, "src": c.root_rank()}
        for i, x in enumerate(xs)
    ]


def _gather(xs, c):
    return [{"tensor": x, "gather_list": [sentinel(x) for _ in xs] if i == c.root else None, "dst": c.root_rank()} for i, x in enumerate(xs)]


def _all_to_all(xs, c):  # member i's input cut into n equal pieces, one per peer; members' pieces may differ
    return [
        {"output_tensor_list": [sentinel(pieces(x, len(xs))[j]) for x in xs], "input_tensor_list": pieces(xs[j], len(xs))}
        for j in range(len(xs))
    ]


def _all_to_all_single(xs, c):
    if c.splits is None:
        return [{"output": sentinel(x), "input": x} for x in xs]
    received = ref.output_split_sizes(c.splits)
    return [
        {"output": sentinel(x, (sum(received[i]),)), "input": x, "output_split_sizes": received[i], "input_split_sizes": c.splits[i]}
        for i, x in enumerate(xs)
    ]


TABLE = {
    c.name: c
    for c in (
        Collective(
            "broadcast",
            "tensor",
            lambda xs, c: [{"tensor": x, "src": c.root_rank()} for x in xs],
            lambda xs, c: ref.broadcast(xs, c.root),
            _alone,
        ),
        Collective(
            "reduce",
            "tensor",
            lambda xs, c: [{"tensor": x, "dst": c.root_rank(), "op": c.op} for x in xs],
            lambda xs, c: ref.reduce(xs, c.root, c.op),
            _alone,
            root_only=True,
        ),
        Collective(
            "all_reduce", "tensor", lambda xs, c: [{"tensor": x, "op": c.op} for x in xs], lambda xs, c: ref.all_reduce(xs, c.op), _alone
        ),
        Collective(
            "reduce_scatter",
            "output",
            _reduce_scatter,
            lambda xs, c: ref.reduce_scatter([pieces(x, len(xs)) for x in xs], c.op),
            _alone,
            divisible=True,
        ),
        Collective(
            "reduce_scatter_tensor",
            "output",
            lambda xs, c: [{"output": sentinel(x, (x.numel() // len(xs),)), "input": x, "op": c.op} for x in xs],
            lambda xs, c: ref.reduce_scatter_tensor(xs, c.op),
            _alone,
            divisible=True,
        ),
        Collective(
            "all_gather",
            "tensor_list",
            lambda xs, c: [{"tensor_list": [sentinel(x) for _ in xs], "tensor": x} for x in xs],
            lambda xs, c: ref.all_gather(xs),
            _gathered,
            list_result=True,
        ),
        Collective(
            "all_gather_into_tensor",
            "output_tensor",
            lambda xs, c: [{"output_tensor": sentinel(x, (len(xs) * x.numel(),)), "input_tensor": x} for x in xs],
            lambda xs, c: ref.all_gather_into_tensor(xs),
            _gathered,
        ),
        Collective(
            "scatter", "tensor", _scatter, lambda xs, c: ref.scatter(pieces(xs[c.root], len(xs)), c.root, len(xs)), _piece, divisible=True
        ),
        Collective("gather", "gather_list", _gather, lambda xs, c: ref.gather(xs, c.root), _alone, root_only=True, list_result=True),
        Collective(
            "all_to_all",
            "output_tensor_list",
            _all_to_all,
            lambda xs, c: ref.all_to_all([pieces(x, len(xs)) for x in xs]),
            _piece,
            list_result=True,
            divisible=True,
        ),
        Collective(
            "all_to_all_single", "output", _all_to_all_single, lambda xs, c: ref.all_to_all_single(xs, c.splits), _alone, divisible=True
        ),  # divisible when its splits are equal
    )
}


def judge_results(judge, outputs: dict, collective: Collective, expected: list, ranks: list[int], root: int) -> None:
    """Every defined result exactly against the reference: ``outputs`` by global rank, ``ranks`` the
    members in order, ``root`` a member index."""
    for i in collective.members_judged(len(ranks), root):
        got, want = outputs[ranks[i]][collective.result], expected[i]
        what = f"rank {ranks[i]} {collective.result}"
        if collective.list_result:
            judge.tensors(got, want, what=what)
        else:
            judge.tensor(got, want, what=what)
