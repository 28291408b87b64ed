"""One entry per collective, as nccl-tests' ``struct testColl`` has one per operation: how it is
called on the n members of a group from one flat input tensor per member, which argument holds the
result, the reference that result must equal, and on which members it is defined.

The deterministic tests (large messages, the cases a backend refuses) call every collective
through this table; the drawn tests of test_collectives.py spell each call out, one per section of
torch.distributed's documentation, with the shapes and lists they draw.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

import reference.collectives as ref
from conformance.examples import sentinel


def _pieces(x: Tensor, n: int) -> list[Tensor]:
    """A member's input cut into n equal pieces (row i of an all_to_all, one chunk per peer)."""
    return list(x.split(x.numel() // n))


@dataclass(frozen=True)
class Collective:
    name: str  # the function of torch.distributed
    result: str  # the argument that holds the result after the call
    # (inputs, root, op) -> each member's keyword arguments; root and op are ignored where they do not apply
    call: Callable[[list[Tensor], int, str | None], list[dict]]
    # (inputs, root, op) -> each member's expected result (the reference, reference/collectives.py)
    expected: Callable[[list[Tensor], int, str | None], list]
    root_only: bool = False  # only the root's result is defined (reduce, gather)
    list_result: bool = False  # the result is a list of tensors

    def members_judged(self, n: int, root: int) -> list[int]:
        return [root] if self.root_only else list(range(n))


TABLE = {c.name: c for c in (
    Collective("broadcast", "tensor",
               lambda xs, root, op: [{"tensor": x, "src": root} for x in xs],
               lambda xs, root, op: ref.broadcast(xs, root)),
    Collective("reduce", "tensor",
               lambda xs, root, op: [{"tensor": x, "dst": root, "op": op} for x in xs],
               lambda xs, root, op: ref.reduce(xs, root, op), root_only=True),
    Collective("all_reduce", "tensor",
               lambda xs, root, op: [{"tensor": x, "op": op} for x in xs],
               lambda xs, root, op: ref.all_reduce(xs, op)),
    Collective("reduce_scatter", "output",
               lambda xs, root, op: [{"output": sentinel(x, (x.numel() // len(xs),)), "input_list": _pieces(x, len(xs)),
                                      "op": op} for x in xs],
               lambda xs, root, op: ref.reduce_scatter([_pieces(x, len(xs)) for x in xs], op)),
    Collective("reduce_scatter_tensor", "output",
               lambda xs, root, op: [{"output": sentinel(x, (x.numel() // len(xs),)), "input": x, "op": op} for x in xs],
               lambda xs, root, op: ref.reduce_scatter_tensor(xs, op)),
    Collective("all_gather_into_tensor", "output_tensor",
               lambda xs, root, op: [{"output_tensor": sentinel(x, (len(xs) * x.numel(),)), "input_tensor": x}
                                     for x in xs],
               lambda xs, root, op: ref.all_gather_into_tensor(xs)),
    # member i's input is cut into n equal pieces, one per peer; members' pieces may differ in size
    Collective("all_to_all", "output_tensor_list",
               lambda xs, root, op: [{"output_tensor_list": [sentinel(_pieces(x, len(xs))[j]) for x in xs],
                                      "input_tensor_list": _pieces(xs[j], len(xs))} for j in range(len(xs))],
               lambda xs, root, op: ref.all_to_all([_pieces(x, len(xs)) for x in xs]), list_result=True),
    Collective("all_to_all_single", "output",
               lambda xs, root, op: [{"output": sentinel(x), "input": x} for x in xs],
               lambda xs, root, op: ref.all_to_all_single(xs, None)),
)}


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
