"""Conformance of tensor-parallel attention (capability ``tp_attention``): causal self-attention with a
fused QKV projection and grouped-query attention, split by head over the group, against the dense
block of reference/transformer_layers.py in float64.

Each example draws a layout (the world, or a subgroup), the key/value heads (1-2 per member), the
query heads per key/value head G (1-3), the head width, the model width, the fused layout of the
dense QKV rows (``concatenated`` [Q | K | V] or Megatron-LM's ``grouped``), biases on or off, a
batch of 1-2 sequences of 1-6 positions (under sequence parallelism 1-3 per member). The ranks wrap
the dense layers (harness/rank/programs/transformer_layers.py), run forward and backward and return
what they hold. In the driver, member by member:

* the fused rows each rank keeps are exactly its heads' rows in the layout for its own head counts
  (a contiguous chunk of the concatenated rows is named: NVIDIA-NeMo/Automodel#1324);
* the output, the input gradient and every shard's gradient equal the dense block's (its slices
  for this rank) within reference.transformer_layers.atol;
* what every member holds whole (the output projection's bias gradient; without sequence
  parallelism the output and the input gradient) is bitwise identical on every member;
* key/value heads that do not split over the group raise a ValueError naming ``num_kv_heads``, its
  size and the group size.

float64 only: what this capability adds is which rows, which heads, which positions, each wrong by
O(0.01) or more; the rounding of column and row layers is the tensor_parallel tests' business.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.tensor_parallel as tp
import parallelism_conformance.reference.transformer_layers as ref
from parallelism_conformance.conformance.examples import Layout, layouts
from parallelism_conformance.conformance.test_tensor_parallel import judge_member, judge_replicated
from parallelism_conformance.conformance.tp_refusals import check_refused
from parallelism_conformance.conformance.verdict import Judge

PROGRAM = "transformer_layers:forward_backward"


@dataclass(frozen=True)
class Example:
    layout: Layout
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    qkv_layout: str
    bias: bool
    batch: int
    seq: int
    seed: int

    @property
    def n(self) -> int:
        return self.layout.size

    def __str__(self) -> str:
        return (
            f"{self.layout}, float64, heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"h={self.hidden}, qkv_layout={self.qkv_layout}, bias={self.bias}, x [{self.batch}, {self.seq}, "
            f"{self.hidden}], seed={self.seed}"
        )

    def tensors(self) -> dict:
        """Dense weights with nn.Linear's init (U(+-1/sqrt(fan_in))), x and the upstream gradient
        N(0, 1), all float64 from the seed."""
        g = torch.Generator().manual_seed(self.seed)
        rows, width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, self.num_heads * self.head_dim

        def uniform(*shape, fan_in):
            return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) / fan_in**0.5

        return {
            "qkv": (uniform(rows, self.hidden, fan_in=self.hidden), uniform(rows, fan_in=self.hidden) if self.bias else None),
            "out": (uniform(self.hidden, width, fan_in=width), uniform(self.hidden, fan_in=width) if self.bias else None),
            "x": torch.randn(self.batch, self.seq, self.hidden, generator=g, dtype=torch.float64),
            "g": torch.randn(self.batch, self.seq, self.hidden, generator=g, dtype=torch.float64),
        }


@st.composite
def examples(draw, max_world_size: int, sequence_parallel: bool) -> Example:
    layout = draw(layouts(max_world_size), label="layout")
    n = layout.size
    kv_heads = draw(st.integers(1, 2), label="kv heads per member") * n
    seq = draw(st.integers(1, 3), label="positions per member") * n if sequence_parallel else draw(st.integers(1, 6), label="positions")
    return Example(
        layout,
        kv_heads * draw(st.integers(1, 3), label="query heads per kv head"),
        kv_heads,
        draw(st.integers(1, 3), label="head_dim"),
        draw(st.integers(1, 8), label="hidden"),
        draw(st.sampled_from(ref.QKV_LAYOUTS), label="qkv layout"),
        draw(st.booleans(), label="bias"),
        draw(st.integers(1, 2), label="batch"),
        seq,
        draw(st.integers(0, 2**16), label="seed"),
    )


def contiguous_chunk(dense: torch.Tensor | None, n: int, index: int, mix: str = "query, key and value heads"):
    """What a rank holds when it cuts the fused rows into n contiguous chunks (Automodel#1324)."""
    if dense is None or dense.shape[0] % n:
        return []
    each = dense.shape[0] // n
    return [
        (
            f"a contiguous chunk of the fused rows: the wrong mix of {mix} (NVIDIA-NeMo/Automodel#1324)",
            dense[index * each : (index + 1) * each],
            None,
        )
    ]


@pytest.mark.capability("tp_attention")
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated_input", "sequence_parallel"])
@given(data=st.data())
def test_attention_split_by_head_equals_the_dense_block(data, ranks, target, sequence_parallel, reproduce):
    example = data.draw(examples(target.max_world_size, sequence_parallel), label="example")
    judge = Judge(f"{example}, sequence_parallel={sequence_parallel}", reproduce)
    t, n = example.tensors(), example.n
    (wq, bq), (wo, bo) = t["qkv"], t["out"]
    heads = {"num_heads": example.num_heads, "num_kv_heads": example.num_kv_heads}
    dense = ref.attention(t["x"], t["qkv"], t["out"], t["g"], **heads, layout=example.qkv_layout)
    mine = (lambda v, i: tp.sequence_shard(v, n, i)) if sequence_parallel else (lambda v, i: v)
    options = {**heads, "sequence_parallel": sequence_parallel, "qkv_layout": example.qkv_layout}
    weights = {"qkv_weight": wq, "qkv_bias": bq, "out_weight": wo, "out_bias": bo}
    per_member = [
        {"layer": "attention", "dense": weights, "options": options, "x": mine(t["x"], i), "grad_output": mine(t["g"], i)} for i in range(n)
    ]
    outputs = judge.run(ranks, example.layout, PROGRAM, per_member)
    shard = " (its sequence shard)" if sequence_parallel else " (full, replicated)"
    notes = {
        "output": shard,
        "grad_input": shard,
        "qkv_weight": " (its query heads' and their key/value heads' rows of the fused weight)",
        "out_bias": " (the whole bias)",
        "grad_out_bias": " (the full gradient on every member)",
    }
    judge_column_then_row(
        judge,
        example.layout,
        outputs,
        dense,
        ("qkv", wq, bq),
        ("out", wo, bo),
        lambda i: ref.qkv_rows(example.qkv_layout, example.num_heads, example.num_kv_heads, example.head_dim, n, i),
        mine,
        notes,
        "query, key and value heads",
        sequence_parallel,
    )


def judge_column_then_row(
    judge: Judge,
    layout: Layout,
    outputs: dict,
    dense: dict,
    column: tuple,
    row: tuple,
    rows_of_member,
    mine,
    notes: dict,
    mix: str,
    sequence_parallel: bool,
) -> None:
    """A fused column-parallel projection ``column`` = (name, W, b), member i keeping the dense rows
    ``rows_of_member(i)``, then a row-parallel one ``row`` = (name, W, b): member by member what it
    keeps (first: a wrong layout is named there, before the values it spoils), the output, the
    input gradient and every shard's gradient against ``dense`` (its slices, ``mine`` for the
    sequence); then what every member holds whole, bitwise."""
    n = layout.size
    (c, wc, bc), (r, wr, br) = column, row
    for i, rank in enumerate(layout.ranks):
        rows = rows_of_member(i)
        expected = {f"{c}_weight": ref.rows_of(wc, rows), f"{c}_bias": ref.rows_of(bc, rows)}
        expected[f"{r}_weight"], expected[f"{r}_bias"] = tp.row_shard(wr, br, n, i)
        expected.update(
            {
                "output": mine(dense["output"], i),
                "grad_input": mine(dense["grad_input"], i),
                f"grad_{c}_weight": ref.rows_of(dense[f"grad_{c}_weight"], rows),
                f"grad_{c}_bias": ref.rows_of(dense.get(f"grad_{c}_bias"), rows),
            }
        )
        expected[f"grad_{r}_weight"], expected[f"grad_{r}_bias"] = tp.row_shard(dense[f"grad_{r}_weight"], dense.get(f"grad_{r}_bias"), n, i)
        tol = {key: ref.atol(want) for key, want in expected.items() if key.startswith(("grad_", "output")) and want is not None}
        judge_member(
            judge,
            rank,
            outputs[rank],
            expected,
            tol,
            notes,
            suspects={f"{c}_weight": lambda i=i: contiguous_chunk(wc, n, i, mix), f"{c}_bias": lambda i=i: contiguous_chunk(bc, n, i, mix)},
        )
    judge_replicated(judge, outputs, [f"grad_{r}_bias", *([] if sequence_parallel else ["output", "grad_input"])])


@pytest.mark.min_ranks(2)
@pytest.mark.capability("tp_attention")
@given(data=st.data())
def test_key_value_heads_that_do_not_split_are_refused(data, ranks, target, reproduce):
    """n must divide num_kv_heads (each member holds whole groups): otherwise from_dense raises a
    ValueError naming num_kv_heads, its size and the group size."""
    layout = data.draw(layouts(target.max_world_size, min_size=2), label="layout")
    n = layout.size
    kv_heads = data.draw(st.integers(1, 3 * n).filter(lambda k: k % n), label="num_kv_heads")
    heads, d, hidden = kv_heads * data.draw(st.integers(1, 2), label="group"), 2, 4
    dense = {
        "qkv_weight": torch.zeros((heads + 2 * kv_heads) * d, hidden, dtype=torch.float64),
        "qkv_bias": None,
        "out_weight": torch.zeros(hidden, heads * d, dtype=torch.float64),
        "out_bias": None,
    }
    options = {"num_heads": heads, "num_kv_heads": kv_heads}
    check_refused(
        Judge(f"{layout}, num_heads={heads}, num_kv_heads={kv_heads}, head_dim={d}", reproduce),
        ranks,
        layout,
        "attention",
        dense,
        options,
        "num_kv_heads",
        kv_heads,
    )
