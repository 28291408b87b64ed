"""Known wrong answers (reference/likely_bugs.py) and how the judge names them."""

from __future__ import annotations

import pytest
import torch

import parallelism_conformance.reference.collectives as ref
import parallelism_conformance.reference.likely_bugs as likely_bugs
from parallelism_conformance.conformance.verdict import Judge


def inputs(dtype, n=3):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return [torch.randn(16, generator=g, dtype=torch.float64).to(dtype) for _ in range(n)]
    return [torch.randint(-100, 100, (16,), generator=g).to(dtype) for _ in range(n)]


def named(judge_call) -> str:
    with pytest.raises(AssertionError) as caught:
        judge_call()
    return str(caught.value).splitlines()[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_avg_without_the_division_is_named(dtype):
    xs = inputs(dtype)
    judge = Judge("example", "reproduce")
    line = named(
        lambda: judge.tensor(
            ref.reduce_values(xs, "SUM"), ref.reduce_values(xs, "AVG"), what="out", suspects=lambda: likely_bugs.reduction(xs, "AVG", 0)
        )
    )
    assert line.endswith("it equals the SUM of the inputs: the division by the group size is missing")


def test_integer_avg_with_floor_is_named_and_printed_as_integers():
    xs = [torch.tensor([-7]), torch.tensor([0])]  # sum -7: trunc(-7/2) = -3, floor = -4
    judge = Judge("example", "reproduce")
    line = named(
        lambda: judge.tensor(torch.tensor([-4]), ref.reduce_values(xs, "AVG"), what="out", suspects=lambda: likely_bugs.reduction(xs, "AVG", 0))
    )
    assert "expected -3, got -4" in line and "divided with floor" in line


def test_an_ignored_op_and_an_untouched_input_are_named():
    xs = inputs(torch.float64)
    judge = Judge("example", "reproduce")
    line = named(
        lambda: judge.tensor(
            ref.reduce_values(xs, "MAX"), ref.reduce_values(xs, "SUM"), what="out", suspects=lambda: likely_bugs.reduction(xs, "SUM", 1)
        )
    )
    assert line.endswith("it equals the MAX of the inputs: the op argument is not honoured")
    line = named(
        lambda: judge.tensor(xs[1].clone(), ref.reduce_values(xs, "SUM"), what="out", suspects=lambda: likely_bugs.reduction(xs, "SUM", 1))
    )
    assert line.endswith("member 1's own input: the reduction never reached this rank")


def test_data_parallel_gradients_summed_local_or_zero_are_named():
    grads = [{"w": t} for t in inputs(torch.float32)]
    mean = (grads[0]["w"] + grads[1]["w"] + grads[2]["w"]) / 3
    atol = torch.tensor(1e-6, dtype=torch.float64)
    judge = Judge("example", "reproduce")
    for wrong, words in [(grads[2]["w"], "never all-reduced"), (mean * 3, "summed, not averaged"), (torch.zeros(16), "zeroed")]:
        line = named(
            lambda: judge.tensor(wrong, mean, what="grad", atol=atol, suspects=lambda: likely_bugs.data_parallel_gradient(grads, "w", 2, atol))
        )
        assert words in line, line


def test_a_wrong_answer_no_known_bug_explains_is_reported_without_a_guess():
    xs = inputs(torch.float64)
    judge = Judge("example", "reproduce")
    line = named(
        lambda: judge.tensor(
            ref.reduce_values(xs, "SUM") + 1, ref.reduce_values(xs, "SUM"), what="out", suspects=lambda: likely_bugs.reduction(xs, "SUM", 0)
        )
    )
    assert "it equals" not in line
