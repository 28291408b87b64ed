"""Conformance of context parallelism (``context_parallel_attention(q, k, v, seq_len, causal=False,
group=None)``, CONTRACT.md), against reference/context_parallel.py.

Each test draws an example (a world size, half the time a subgroup of it; 1-3 heads of width
1-8; a sequence of 2n to 6n + 5 positions, so it rarely divides into 2n equal chunks; causal or
not; float64 or float32; values at two magnitudes), builds Q, K, V and the upstream gradient in the
driver, and sends each member only its load-balanced rows (chunks i and 2n-1-i of 2n). The ranks
run the implementation's attention and backward (harness/rank/programs/context_parallel.py). In the
driver, member by member, within reference.context_parallel.atol: the output rows and dQ, dK, dV of
the member's rows equal those of dense attention over the whole sequence, computed in float64.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.context_parallel as ref
from parallelism_conformance.conformance.attention_examples import AttentionExample as Example
from parallelism_conformance.conformance.attention_examples import attention_examples as examples
from parallelism_conformance.conformance.verdict import Judge, run_or_skip

PROGRAM = "context_parallel:attention"


def run(judge: Judge, ranks, example: Example) -> dict:
    t, n = example.tensors(), example.layout.size
    return run_or_skip(
        judge,
        ranks,
        example.layout,
        PROGRAM,
        [
            {
                **{name: ref.shard(t[name], n, i) for name in ("q", "k", "v", "grad_output")},
                "seq_len": example.seq_len,
                "causal": example.causal,
            }
            for i in range(n)
        ],
    )


@pytest.mark.capability("context_parallel")
@given(data=st.data())
def test_ring_attention_equals_dense_attention(data, ranks, target, reproduce):
    example = data.draw(examples(target.max_world_size), label="example")
    judge = Judge(str(example), reproduce)
    outputs = run(judge, ranks, example)
    t, n = example.tensors(), example.layout.size
    dense = ref.attention_with_grads(t["q"], t["k"], t["v"], t["grad_output"], example.causal)
    tolerance = ref.atol(t["q"], t["k"], t["v"], t["grad_output"], example.dtype)
    notes = {
        "output": "its rows of softmax(QK^T/sqrt(d) + M) V",
        "grad_q": "dL/dQ of its rows",
        "grad_k": "dL/dK of its rows (from every rank's queries)",
        "grad_v": "dL/dV of its rows (from every rank's queries)",
    }
    for i, rank in enumerate(example.layout.ranks):
        rows = ref.positions(example.seq_len, n, i).tolist()
        for key, note in notes.items():
            judge.tensor(
                outputs[rank][key],
                ref.shard(dense[key], n, i),
                atol=tolerance[key],
                what=f"rank {rank} (group rank {i}, positions {rows[:3]}...) {key.replace('_', ' ')} ({note})",
            )


@pytest.mark.min_ranks(2)
@pytest.mark.capability("context_parallel")
@given(data=st.data())
def test_causal_ring_attention_across_ranks(data, ranks, target, reproduce):
    """Causal only, two ranks or more: every rank's rows see keys of other ranks' chunks, before and
    after their own, so a mask on local instead of global positions is caught."""
    example = data.draw(examples(target.max_world_size, min_size=2).filter(lambda e: e.causal), label="example")
    judge = Judge(str(example), reproduce)
    outputs = run(judge, ranks, example)
    t, n = example.tensors(), example.layout.size
    dense = ref.attention_with_grads(t["q"], t["k"], t["v"], t["grad_output"], True)
    tolerance = ref.atol(t["q"], t["k"], t["v"], t["grad_output"], example.dtype)
    for i, rank in enumerate(example.layout.ranks):
        for key in ("output", "grad_q", "grad_k", "grad_v"):
            judge.tensor(
                outputs[rank][key],
                ref.shard(dense[key], n, i),
                atol=tolerance[key],
                what=f"rank {rank} (group rank {i}) {key.replace('_', ' ')}, causal",
            )
