"""The flight recorder and the disagreement report (harness/rank/flight_recorder.py,
harness/driver/disagreement.py): each kind of disagreement between ranks fails with the ranks, the calls
and the implementation's source lines named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parallelism_conformance.harness.driver.failures import RankFailure, RanksCrashed, RanksHung
from parallelism_conformance.harness.driver.pool import WorldPool

FIXTURES = Path(__file__).parent / "fixtures"
MUTANTS = Path(__file__).parent.parent / "mutants" / "collectives"  # the disagreement mutants
CALL = "parallelism_conformance.harness.rank.programs.collectives:call"


def line_of(fixture: str, marker: str) -> str:
    lines = (MUTANTS / f"{fixture}.py").read_text().splitlines()
    return f"{fixture}.py:{next(i for i, text in enumerate(lines, 1) if marker in text)}"


def all_reduce_task(n: int, numel: int = 4) -> list[dict]:
    return [{"function": "all_reduce", "arguments": {"tensor": torch.ones(numel)}, "group": None}] * n


@pytest.fixture(scope="module")
def pool():
    with WorldPool("gloo", timeout_s=3.0) as pool:
        yield pool


def failure_text(pool, n: int, fixture: str) -> str:
    with pytest.raises((RankFailure, RanksHung, RanksCrashed)) as caught:
        pool.run(n, CALL, all_reduce_task(n), impl=str((MUTANTS if fixture.startswith("disagree") else FIXTURES) / f"{fixture}.py"))
    return str(caught.value)


def test_a_size_disagreement_names_both_calls_and_lines(pool):
    text = failure_text(pool, 2, "disagree_size")
    first = text.splitlines()[0]
    assert "the ranks disagree: size mismatch: " in first
    assert f"rank 0: send(to 1, 8 x float32 = 32 B) at {line_of('disagree_size', 'SEND_LINE')}" in first
    assert f"rank 1: recv(from 0, 4 x float32 = 16 B) at {line_of('disagree_size', 'RECV_LINE')}" in first


def test_a_tag_disagreement_is_named(pool):
    text = failure_text(pool, 2, "disagree_tag")
    assert "tag mismatch: rank 0: send(to 1, 4 x float32 = 16 B, tag 7)" in text.splitlines()[0]
    assert line_of("disagree_tag", "RECV_LINE") in text.splitlines()[0]


def test_a_mistaken_peer_is_named_from_both_sides(pool):
    text = failure_text(pool, 3, "disagree_peer")
    assert f"rank 1: recv(from 0, 4 x float32 = 16 B) at {line_of('disagree_peer', 'RECV_LINE')} waits for a message rank 0 never sent" in text
    assert f"rank 0: send(to 2, 4 x float32 = 16 B) at {line_of('disagree_peer', 'SEND_LINE')} was never received" in text


def test_a_skipped_collective_names_the_rank_that_never_called_it(pool):
    text = failure_text(pool, 3, "disagree_skipped_collective")
    assert (
        "rank 2 never called the all_reduce (all_reduce(group [0, 1, 2], 4 x float32 = 16 B) at "
        f"{line_of('disagree_skipped_collective', 'COLLECTIVE_LINE')}) that ranks 0, 1 are waiting in" in text
    )


def test_a_circular_wait_is_named(pool):
    text = failure_text(pool, 2, "disagree_circular_wait")
    line = line_of("disagree_circular_wait", "RECV_LINE")
    assert (
        f"ranks 0 and 1 all wait to receive from each other: rank 0: recv(from 1, 4 x float32 = 16 B) at {line}; "
        f"rank 1: recv(from 0, 4 x float32 = 16 B) at {line}"
    ) in text


def test_a_silent_dtype_disagreement_is_named_for_the_judge(pool):
    pool.run(2, CALL, all_reduce_task(2), impl=str(MUTANTS / "disagree_dtype.py"))  # gloo garbles it silently
    told = pool.disagreements(2)
    assert told and told[0].startswith(
        f"dtype mismatch: rank 0: send(to 1, 2 x float64 = 16 B) at {line_of('disagree_dtype', 'SEND_LINE')}; rank 1: recv(from 0, 4 x float32"
    )


def test_a_stray_message_names_the_send_nobody_received(pool):
    text = failure_text(pool, 2, "stray_send_impl")
    assert "rank 0: send(to 1," in text and "was never received: rank 1 posted no matching receive" in text


def test_members_of_an_all_to_all_or_a_scatter_may_pass_different_sizes_and_do_not_disagree():
    """Unequal splits (expert parallelism: 6 tokens on one rank, 3 on the other) and a scatter's
    input, which only its root holds, are not a mismatch; an all_reduce of different sizes is.
    (An outside author's correct expert-parallel all_to_all_single was named as one, before.)"""
    from parallelism_conformance.harness.driver.disagreement import Call, explain

    def call(rank, op, numel, root=None):
        return Call(rank, 0, op, "ok", "float64", (numel,), None, root, 0, 1, (0, 2), numel, 8 * numel, f"impl.py:{rank}")

    for op, sizes, root in [("all_to_all_single", (24, 12), None), ("all_to_all", (24, 12), None), ("scatter", (0, 16), 2)]:
        calls = {0: [call(0, op, sizes[0], root)], 2: [call(2, op, sizes[1], root)]}
        assert not any("mismatch" in line for line in explain(calls, {0: "ok", 2: "ok"})), op
    calls = {0: [call(0, "all_reduce", 24)], 2: [call(2, "all_reduce", 12)]}
    assert any("collective mismatch in group [0, 2]" in line for line in explain(calls, {0: "ok", 2: "ok"}))
