"""Known wrong answers: what a specific, common bug makes an implementation return, so that the
driver can say which bug a wrong output points to ("it equals the SUM: the division by the group
size is missing") instead of only that it is wrong. Each function returns candidates
``(description, tensor, atol)`` in the order they are tried; the first one the wrong output
matches within ``atol`` (None: the truth's own tolerance) is reported. A match is a strong hint, never a verdict:
the verdict is the comparison with the truth, made before any of these is consulted.

The bugs come from the mutants under mutants/ and from student code (issue 13): an op ignored, AVG
without the division, integer AVG with floor instead of truncation, a collective that never ran,
the chunk of another member, a gradient never all-reduced, summed instead of averaged, taken from
rank 0, or zeroed.

Never imports torch.distributed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parallelism_conformance.reference.collectives import OPS, op_applies, reduce_values
from parallelism_conformance.reference.tolerance import reduction_atol

Candidate = tuple[str, Tensor, "Tensor | None"]


def reduction(inputs: list[Tensor], op: str, index: int) -> list[Candidate]:
    """Wrong results of a reduction (all_reduce, reduce) of ``inputs`` with ``op``, as seen by the
    member at ``index``."""
    candidates: list[Candidate] = []
    n, dtype = len(inputs), inputs[0].dtype
    if op == "AVG":
        candidates.append(
            ("the SUM of the inputs: the division by the group size is missing", reduce_values(inputs, "SUM"), reduction_atol(inputs, "SUM"))
        )
        if not dtype.is_floating_point:
            floor = torch.div(reduce_values(inputs, "SUM"), n, rounding_mode="floor").to(dtype)
            candidates.append(("the wrapped SUM divided with floor: integer AVG rounds toward zero (trunc)", floor, None))
    for other in OPS:
        if other != op and op_applies(other, dtype) and not (op == "AVG" and other == "SUM"):
            candidates.append(
                (f"the {other} of the inputs: the op argument is not honoured", reduce_values(inputs, other), reduction_atol(inputs, other))
            )
    candidates.append((f"member {index}'s own input: the reduction never reached this rank", inputs[index], None))
    return candidates


def broadcast(inputs: list[Tensor], src_index: int, index: int) -> list[Candidate]:
    """Wrong results of broadcasting member ``src_index``'s tensor, seen by member ``index``."""
    candidates: list[Candidate] = []
    if src_index != 0:
        candidates.append(("group member 0's tensor: src was read as a group rank, it is a global rank", inputs[0], None))
    candidates.append((f"member {index}'s own tensor: nothing was received", inputs[index], None))
    return candidates


def chunk(expected: list[Tensor], index: int, inputs: list[Tensor] | None = None) -> list[Candidate]:
    """Wrong results of a collective that gives member ``index`` one chunk of ``expected``: another
    member's chunk (chunks indexed by global rank, or by the wrong rank), or its untouched input."""
    candidates: list[Candidate] = [
        (f"the chunk of group member {j}: chunks are indexed wrongly (global rank instead of group rank?)", chunk, None)
        for j, chunk in enumerate(expected)
        if j != index
    ]
    if inputs is not None:
        candidates.append((f"member {index}'s own input: nothing was received", inputs[index], None))
    return candidates


def data_parallel_gradient(slice_grads: list[dict[str, Tensor]], name: str, rank: int, atol: Tensor) -> list[Candidate]:
    """Wrong gradients of parameter ``name`` on ``rank`` after synchronization, from the per-rank
    gradients grad L_r (``slice_grads[r]``) whose mean is the truth, judged within ``atol`` (the
    truth's; n times it for the sum)."""
    local = [g[name] for g in slice_grads]
    total = local[0].clone()
    for g in local[1:]:
        total = total + g
    candidates: list[Candidate] = []
    if len(local) > 1:
        candidates.append(("the rank's own local gradient: it was never all-reduced", local[rank], None))
        candidates.append(("the SUM over ranks: summed, not averaged (divide by the world size)", total, atol * len(local)))
        candidates.append(("rank 0's local gradient: rank 0's gradient was copied instead of averaged", local[0], None))
    candidates.append(("zero: the gradient was zeroed or never written back from the communication buffer", torch.zeros_like(local[0]), None))
    return candidates


def token_loss_gradient(
    slice_grads: list[dict[str, Tensor]], rank_counts: list[int], divide_factor: float, name: str, atol: Tensor
) -> list[Candidate]:
    """Wrong gradients of ``name`` for a loss normalised by the global token count C = sum_r c_r
    (reference/token_loss.py), from each rank's sum_j grad S_rj (``slice_grads``), its valid
    targets c_r (``rank_counts``) and the divide factor f: averaged over the n ranks instead of
    divided by f (the truth times f / n), or each rank's sum divided by its own count."""
    n, total = len(slice_grads), sum(rank_counts)
    if n < 2 or total == 0:
        return []
    summed = torch.zeros_like(slice_grads[0][name])
    own = torch.zeros_like(summed)
    for grads, count in zip(slice_grads, rank_counts):
        summed += grads[name]
        if count:
            own += grads[name] / count
    return [
        (
            f"the truth times f/n = {divide_factor:g}/{n}: the gradients were averaged over the ranks, not divided by "
            "gradient_divide_factor, after the loss was already divided by the global count (divided twice, "
            "torchtitan#2323)",
            summed / total * divide_factor / n,
            atol * max(1.0, divide_factor / n),
        ),
        (
            "each rank's loss divided by its own count of valid targets, not the global one: global_token_count must sum the ranks' counts",
            own,
            None,
        ),
    ]


def replicated_gradient(full: Tensor, atol: Tensor, n: int, sequence_parallel: bool) -> list[Candidate]:
    """Wrong gradients of a parameter every member holds whole (a LayerNorm before the
    tensor-parallel MLP), whose truth is ``full``: n times it (all-reduced where each member already
    had the whole gradient), or 1/n of it (averaged instead of summed over sequence shards)."""
    if n < 2:
        return []
    candidates = [
        (
            f"{n} times the gradient: it was all-reduced where every member already held the whole of it"
            + ("" if sequence_parallel else " (without sequence parallelism the norm sees the whole input)"),
            full * n,
            atol * n,
        )
    ]
    if sequence_parallel:
        candidates.append((f"1/{n} of the gradient: the members' partial gradients were averaged, not summed", full / n, atol))
    return candidates


def row_parallel_output(output: Tensor, bias: Tensor | None, n: int, atol: Tensor) -> list[Candidate]:
    """A row-parallel layer's (or the MLP's) full output, y = x W^T + b, when each of the n ranks
    adds the bias to its partial sum before the all-reduce: y + (n - 1) b."""
    if bias is None or n < 2:
        return []
    return [
        (
            f"the output with the bias added {n} times: every rank adds it before the all-reduce (add it once, after)",
            (output.to(torch.float64) + (n - 1) * bias.to(torch.float64)).to(output.dtype),
            atol * n,
        )
    ]


def pipeline_loss(loss: Tensor, m: int, atol: Tensor) -> list[Candidate]:
    """The step's loss, the mean over m microbatches, when it is summed instead."""
    return [(f"{m} times the mean: the microbatch losses were summed, not averaged", loss * m, atol * m)] if m > 1 else []


def pipeline_gradient(microbatch_grads: list[dict[str, Tensor]], name: str, atol: Tensor, calls: int = 1) -> list[Candidate]:
    """A parameter's gradient, sum_k grad(L_k / m) (``calls`` times, accumulated over that many
    pipeline_step calls), when the 1/m is missing or .grad is reset between microbatches (only the
    last, or the first, microbatch's term is left), or when each call divides the whole accumulated
    .grad by m."""
    terms = [g[name] for g in microbatch_grads]
    m = len(terms)
    if m < 2:
        return []
    total = terms[0].clone()
    for t in terms[1:]:
        total = total + t
    if calls == 2:
        return [
            (
                f"the gradient times 1 + 1/{m}: the earlier call's accumulated .grad was divided by m again when "
                "the later call rescaled every .grad at its end (torchtitan#1733): divide each microbatch's loss, "
                "not the accumulated gradients",
                total * (1 + 1 / m),
                atol * 2,
            ),
            ("the gradient of the last call alone: .grad was reset at the start of pipeline_step", total, atol),
        ]
    return [
        (f"{m} times the gradient: each microbatch's loss was not divided by m", total * m, atol * m),
        ("the last microbatch's term alone: .grad is zeroed inside the microbatch loop", terms[-1], atol),
        ("the first microbatch's term alone: the later microbatches' backward never reached this stage", terms[0], atol),
    ]
