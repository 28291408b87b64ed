"""Conformance of dropout inside a tensor-parallel block (capability ``tp_dropout``):
``TensorParallelMLP.from_dense(fc1, fc2, group, sequence_parallel, dropout=p)`` equals the dense
block with torch's dropout on its hidden activations and on its output, the masks drawn from the
default generator, which the harness seeds alike on every member (reference/tensor_parallel.py:
dropout_masks, dropout_mlp).

Reported bugs this is for: Megatron-LM#206 (the data loader drew from the random generator on
tensor-parallel rank 0 only, so the members' generators parted and the dropout of the replicated
region drifted across them), and the reason Megatron keeps a separate stream for the sharded region:
a shard that draws its mask on its own shape from a generator in the same state as the other
members' draws the same mask as every other shard, so the dropout is correlated across the hidden
units. Neither shows in a loss curve.

Each example draws a layout of n = 1-4 members, float32 or float64, h, ffn a multiple of n, leading
dims, bias, p in {0.25, 0.5}, sequence parallelism or not, and a seed. In the driver: each member's
output and input gradient (whole, or its sequence shard), its shards of the weights' gradients and
the whole fc2 bias gradient against the dense block under the same masks (the MLP's bound times
(1/(1-p))^2), and what every member holds whole bitwise identical on every member.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.tensor_parallel as ref
from parallelism_conformance.conformance.tensor_parallel_examples import examples
from parallelism_conformance.conformance.test_tensor_parallel import PROGRAM, judge_member, judge_replicated
from parallelism_conformance.conformance.verdict import Judge, run_or_skip


@pytest.mark.capability("tp_dropout")
@pytest.mark.parametrize("sequence_parallel", [False, True])
@given(data=st.data())
def test_tensor_parallel_dropout_is_the_dense_dropout(data, ranks, target, sequence_parallel, reproduce):
    example = data.draw(examples(target.max_world_size, "sequence" if sequence_parallel else "ffn"), label="example")
    p = data.draw(st.sampled_from([0.25, 0.5]), label="dropout")
    rng_seed = data.draw(st.integers(0, 2**16), label="rng seed")
    n = example.n
    if target.plan.device_type(n) != "cpu":
        pytest.skip("the masks of a CUDA rank come from its device's generator, which the driver's CPU reference does not replay")
    judge = Judge(f"{example}, sequence_parallel={sequence_parallel}, dropout={p}, rng_seed={rng_seed}", reproduce)
    t = example.tensors()
    (w1, b1), (w2, b2) = t["params"]
    x, g = t["x"], t["g"]
    masks = ref.dropout_masks(tuple(x.shape), example.ffn, p, rng_seed, example.dtype)
    dense = ref.dropout_mlp(x, (w1, b1), (w2, b2), g, masks)
    atol = ref.dropout_mlp_atol(x, (w1, b1), (w2, b2), g, n, p)
    mine = (lambda t, i: ref.sequence_shard(t, n, i)) if sequence_parallel else (lambda t, i: t)
    weights = {"fc1_weight": w1, "fc1_bias": b1, "fc2_weight": w2, "fc2_bias": b2}
    outputs = run_or_skip(
        judge,
        ranks,
        example.layout,
        PROGRAM,
        [
            {
                "layer": "mlp",
                "dense": weights,
                "options": {"sequence_parallel": sequence_parallel, "dropout": p},
                "x": mine(x, i),
                "grad_output": mine(g, i),
                "rng_seed": rng_seed,
            }
            for i in range(n)
        ],
    )
    notes = {
        "output": " (after the output dropout: the dense mask" + (", its sequence shard)" if sequence_parallel else ", whole on every member)"),
        "grad_fc1_weight": " (through the hidden dropout: this member's columns of the dense mask)",
    }
    for i, rank in enumerate(example.layout.ranks):
        expected = {"output": mine(dense["output"], i), "grad_input": mine(dense["grad_input"], i)}
        tol = {"output": mine(atol["output"], i), "grad_input": mine(atol["grad_input"], i)}
        for prefix, split in (("fc1_", ref.column_shard), ("fc2_", ref.row_shard)):
            gw, gb = split(dense["grad_" + prefix + "weight"], dense.get("grad_" + prefix + "bias"), n, i)
            expected["grad_" + prefix + "weight"], expected["grad_" + prefix + "bias"] = gw, gb
            tol["grad_" + prefix + "weight"], tol["grad_" + prefix + "bias"] = split(
                atol["grad_" + prefix + "weight"], atol.get("grad_" + prefix + "bias"), n, i
            )
        judge_member(judge, rank, outputs[rank], expected, tol, notes)
    judge_replicated(judge, outputs, ["grad_fc2_bias", *([] if sequence_parallel else ["output", "grad_input"])])
