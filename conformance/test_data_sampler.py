"""Conformance of distributed sampling (``DistributedSampler(dataset, num_replicas, rank, shuffle,
seed, drop_last)`` with ``set_epoch``, CONTRACT.md), against reference/data_sampling.py.

The bugs it is after show in no loss curve: samples seen twice or never (accelerate#226 counted
10,167 samples for a 10,000-sample set), replicas that disagree on the order because it came from a
random state of their own (Megatron-LM#206's data loader used the RNG on one rank only), an order
that never changes between epochs, replicas of unequal length (one replica's extra batch waits in
its all-reduce for ranks that have finished).

Each test draws a dataset size, a world and its data-parallel replicas (every rank its own, or two
ranks per replica, as the ranks of one tensor-parallel group are), shuffle, seed, drop_last and two
epochs; each rank builds the sampler as its replica with a global random state of its own
(harness/rank/programs/data_sampler.py). In the driver, for each epoch: ranks of one replica yield
the same indices; every replica as many as its ``len()``, all the same number, ceil(N / n) (or
floor with drop_last); every sample seen at least once, and only the padding twice (with drop_last,
none twice); a second sampler built alike yields the same order; with shuffle and at least
``CHANGES_FROM`` samples, the next epoch's order differs.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.data_sampling as ref
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.verdict import Judge

PROGRAM = "data_sampler:epochs"
CHANGES_FROM = 10  # samples: two permutations drawn alike are equal with probability 1/N! (< 3e-7)


@st.composite
def sampler_examples(draw, max_world_size: int) -> dict:
    n = draw(st.integers(1, max_world_size), label="world_size")
    paired = n % 2 == 0 and draw(st.booleans(), label="two ranks per replica")
    first = draw(st.integers(0, 3), label="epoch")
    return {
        "world_size": n,
        "replicas": n // 2 if paired else n,
        "samples": draw(st.integers(1, 40), label="samples"),
        "shuffle": draw(st.booleans(), label="shuffle"),
        "seed": draw(st.integers(0, 2**16), label="seed"),
        "drop_last": draw(st.booleans(), label="drop_last"),
        "epochs": [first, first + draw(st.integers(1, 3), label="later epoch")],
    }


@pytest.mark.capability("data_sampler")
@given(data=st.data())
def test_every_sample_once_per_epoch_and_replicas_in_step(data, ranks, target, reproduce):
    example = data.draw(sampler_examples(target.max_world_size), label="example")
    n, replicas, samples = example["world_size"], example["replicas"], example["samples"]
    judge = Judge(", ".join(f"{k}={v}" for k, v in example.items()), reproduce)
    settings = {k: example[k] for k in ("samples", "replicas", "shuffle", "seed", "drop_last", "epochs")}
    outputs = judge.run(ranks, Layout(n), PROGRAM, [{**settings, "replica": r % replicas} for r in range(n)])
    orders = []
    for e, epoch in enumerate(example["epochs"]):
        per_replica = []
        for replica in range(replicas):
            members = [r for r in range(n) if r % replicas == replica]
            first = outputs[members[0]]["epochs"][e]
            for r in members[1:]:
                if outputs[r]["epochs"][e] != first:
                    judge.fail(
                        f"epoch {epoch}: ranks {members[0]} and {r}, one replica ({replica}), yield different "
                        f"indices: {first[:8]} and {outputs[r]['epochs'][e][:8]}; the order may depend on the "
                        f"seed, the epoch and the replica only, never on a rank's own random state"
                    )
            per_replica.append(first)
        for r in range(n):
            got = outputs[r]
            if got["lengths"][e] != len(got["epochs"][e]):
                judge.fail(f"epoch {epoch}, rank {r}: len(sampler) is {got['lengths'][e]} but it yields {len(got['epochs'][e])} indices")
        problems = ref.coverage_problems(per_replica, samples, example["drop_last"])
        if problems:
            judge.fail(f"epoch {epoch}: " + "; ".join(problems))
        orders.append(per_replica)
    for r in range(n):
        if outputs[r]["again"] != outputs[r]["epochs"][0]:
            judge.fail(
                f"rank {r}: a second sampler with the same seed at epoch {example['epochs'][0]} yields "
                f"{outputs[r]['again'][:8]}, the first {outputs[r]['epochs'][0][:8]}: a resumed run would "
                f"see another order"
            )
    if example["shuffle"] and samples >= CHANGES_FROM and orders[0] == orders[1]:
        judge.fail(
            f"epochs {example['epochs'][0]} and {example['epochs'][1]} yield the same order on every replica: set_epoch must change the shuffle"
        )
