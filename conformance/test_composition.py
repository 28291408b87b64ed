"""Conformance of parallelisms composed on a 2D device mesh (capability ``composition``): tensor
parallelism inside each row of a dp x tp mesh, data parallelism down each column
(reference/mesh.py), against the dense MLP on the whole global batch (reference/tensor_parallel.py).

Each test draws a mesh (dp x tp <= --max-world-size), an MLP (h, ffn a multiple of tp, bias on or
off, float32 or float64), rows per replica and 0-1 extra leading dims. The driver sends every rank
the dense weights, its replica's rows of the input and of the upstream gradient, and the mesh's
groups; the ranks run the implementation's TensorParallelMLP on their row's group and sum each
gradient shard over their column's group with the implementation's all_reduce
(harness/rank/programs/composition.py). In the driver, rank by rank at mesh position (d, t):

* the shards are exactly tensor-parallel index t's chunks of the dense weights;
* output and input gradient are replica d's rows of the dense ones; every gradient shard is shard t
  of the dense gradient over the whole global batch (the loss is summed over it), within
  reference.tensor_parallel.mlp_atol taken with n = dp tp partial sums;
* bitwise: output and input gradient agree across each tensor-parallel group, every gradient shard
  across its data-parallel group, and the whole fc2 bias gradient on every rank of the mesh.

Many independent groups are live at once here (dp row groups, tp column groups), so an
implementation that talks to the default group, or mixes group and global ranks, fails here even
where a single group of the first ranks hides it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.tensor_parallel as ref
from parallelism_conformance.conformance.examples import Layout, dense_layers
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.reference import mesh

PROGRAM = "composition:dp_tp_mlp"
DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Example:
    dp: int
    tp: int
    h: int
    ffn: int
    rows: int  # per replica
    extra: tuple[int, ...]  # 0-1 extra leading dims after the batch dim
    bias: bool
    dtype: torch.dtype
    seed: int

    def __str__(self) -> str:
        return (
            f"mesh dp={self.dp} x tp={self.tp}, h={self.h}, ffn={self.ffn}, {self.rows} rows per replica, "
            f"extra leading dims {self.extra}, bias={self.bias}, {str(self.dtype).removeprefix('torch.')}, "
            f"seed={self.seed}"
        )

    def tensors(self) -> dict:
        shape = (self.dp * self.rows, *self.extra, self.h)
        t = dense_layers(self.seed, self.dtype, [(self.h, self.ffn), (self.ffn, self.h)], self.bias, shape, shape)
        return {"fc1": t["params"][0], "fc2": t["params"][1], "x": t["x"], "g": t["g"]}


@st.composite
def examples(draw, max_world_size: int) -> Example:
    world = draw(st.integers(1, max_world_size), label="world size")
    tp = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]), label="tp")
    return Example(
        dp=world // tp,
        tp=tp,
        h=draw(st.integers(1, 8), label="h"),
        ffn=tp * draw(st.integers(1, 4), label="ffn per tp rank"),
        rows=draw(st.integers(1, 3), label="rows per replica"),
        extra=tuple(draw(st.lists(st.integers(1, 3), max_size=1), label="extra leading dims")),
        bias=draw(st.booleans(), label="bias"),
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        seed=draw(st.integers(0, 2**16), label="seed"),
    )


def replica_rows(t: torch.Tensor, example: Example, d: int) -> torch.Tensor:
    return t.chunk(example.dp, dim=0)[d]


@pytest.mark.capability("composition")
@given(data=st.data())
def test_tensor_parallel_rows_and_data_parallel_columns_equal_the_dense_mlp(data, ranks, target, reproduce):
    example = data.draw(examples(target.max_world_size), label="example")
    judge = Judge(str(example), reproduce)
    t = example.tensors()
    (w1, b1), (w2, b2), x, g = t["fc1"], t["fc2"], t["x"], t["g"]
    n = example.dp * example.tp
    dense, atol = ref.mlp(x, (w1, b1), (w2, b2), g), ref.mlp_atol(x, (w1, b1), (w2, b2), g, n)
    rows_groups = mesh.tensor_parallel_groups(example.dp, example.tp)
    column_groups = mesh.data_parallel_groups(example.dp, example.tp)
    weights = {"fc1_weight": w1, "fc1_bias": b1, "fc2_weight": w2, "fc2_bias": b2}
    per_rank = []
    for rank in range(n):
        d, _ = mesh.coordinates(rank, example.dp, example.tp)
        per_rank.append(
            {
                "tensor_parallel_groups": rows_groups,
                "data_parallel_groups": column_groups,
                "dense": weights,
                "x": replica_rows(x, example, d).contiguous(),
                "grad_output": replica_rows(g, example, d).contiguous(),
            }
        )
    outputs = judge.run(ranks, Layout(n), PROGRAM, per_rank)
    for rank in range(n):
        d, i = mesh.coordinates(rank, example.dp, example.tp)
        got = outputs[rank]
        where = f"rank {rank} (mesh d={d}, t={i})"
        for key in ("output", "grad_input"):
            judge.tensor(
                got[key],
                replica_rows(dense[key], example, d),
                atol=replica_rows(atol[key], example, d),
                what=f"{where} {key.replace('_', ' ')} (replica {d}'s rows of the dense one)",
            )
        for prefix, split, (w, b) in (("fc1_", ref.column_shard, (w1, b1)), ("fc2_", ref.row_shard, (w2, b2))):
            shard = dict(zip(("weight", "bias"), split(w, b, example.tp, i)))
            grads = dict(zip(("weight", "bias"), split(dense[f"grad_{prefix}weight"], dense.get(f"grad_{prefix}bias"), example.tp, i)))
            tols = dict(zip(("weight", "bias"), split(atol[f"grad_{prefix}weight"], atol.get(f"grad_{prefix}bias"), example.tp, i)))
            for kind in ("weight", "bias"):
                key = prefix + kind
                if shard[kind] is None:
                    if got.get(key) is not None or got.get("grad_" + key) is not None:
                        judge.fail(f"{where} {key}: the layer has no bias, got one")
                    continue
                judge.tensor(got[key], shard[kind], what=f"{where} {key} (tensor-parallel shard {i} of {example.tp})")
                judge.tensor(
                    got["grad_" + key],
                    grads[kind],
                    atol=tols[kind],
                    what=f"{where} gradient of {key}, summed over its data-parallel group (shard {i} of the "
                    f"dense gradient over the whole global batch)",
                )
    for members in rows_groups:
        for key in ("output", "grad_input"):
            judge.bitwise_identical(
                {r: outputs[r][key] for r in members}, what=f"{key.replace('_', ' ')} across tensor-parallel group {members}"
            )
    for members in column_groups:
        for key in ("grad_fc1_weight", "grad_fc1_bias", "grad_fc2_weight", "grad_fc2_bias"):
            if outputs[members[0]].get(key) is not None:
                judge.bitwise_identical(
                    {r: outputs[r][key] for r in members}, what=f"{key.replace('_', ' ')} across data-parallel group {members}"
                )
    if b2 is not None:
        judge.bitwise_identical(
            {r: outputs[r]["grad_fc2_bias"] for r in range(n)}, what="the whole fc2 bias gradient on every rank of the mesh"
        )
