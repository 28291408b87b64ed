"""Conformance of the tensor-parallel SwiGLU MLP (capability ``tp_swiglu``): a fused [gate | up]
projection, column parallel, and a row-parallel down projection, against the dense SwiGLU of
reference/transformer_layers.py in float64.

Each example draws a layout (the world, or a subgroup), the model width, the ffn width f (1-4 per
member), biases on or off, 0-2 leading dims of the input (under sequence parallelism the last is
the sequence, 1-3 positions per member). In the driver, member by member:

* the fused rows each rank keeps are exactly [gate_r | up_r], rows r of the gate's f rows and of
  the value's (a contiguous chunk of the fused rows is named: NVIDIA-NeMo/Automodel#1324);
* the output, the input gradient and every shard's gradient equal the dense MLP's (its slices for
  this rank) within reference.transformer_layers.atol;
* the down projection's bias gradient (and without sequence parallelism the output and the input
  gradient) is bitwise identical on every member;
* an ffn width that does not split raises a ValueError naming ``ffn``, its size and the group size.

float64 only, for the reason given in conformance/test_tp_attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.tensor_parallel as tp
import parallelism_conformance.reference.transformer_layers as ref
from parallelism_conformance.conformance.examples import Layout, dense_layers, layouts
from parallelism_conformance.conformance.test_tp_attention import PROGRAM, judge_column_then_row
from parallelism_conformance.conformance.tp_refusals import check_refused
from parallelism_conformance.conformance.verdict import Judge

GATE_AND_UP = "gate and value rows (a rank's gate rows must meet the value rows of the same hidden units)"


@dataclass(frozen=True)
class Example:
    layout: Layout
    hidden: int
    ffn: int
    leading: tuple[int, ...]  # the input's dims before the last (under sequence parallelism the last is the sequence)
    bias: bool
    seed: int

    def __str__(self) -> str:
        return f"{self.layout}, float64, h={self.hidden}, ffn={self.ffn}, input leading dims {self.leading}, bias={self.bias}, seed={self.seed}"


@st.composite
def examples(draw, max_world_size: int, sequence_parallel: bool) -> Example:
    layout = draw(layouts(max_world_size), label="layout")
    n = layout.size
    leading = tuple(draw(st.lists(st.integers(1, 3), max_size=2), label="leading dims"))
    if sequence_parallel:
        leading = (*leading[:1], draw(st.integers(1, 3), label="positions per member") * n)
    return Example(
        layout,
        draw(st.integers(1, 8), label="hidden"),
        draw(st.integers(1, 4), label="ffn per member") * n,
        leading,
        draw(st.booleans(), label="bias"),
        draw(st.integers(0, 2**16), label="seed"),
    )


@pytest.mark.capability("tp_swiglu")
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated_input", "sequence_parallel"])
@given(data=st.data())
def test_swiglu_with_fused_gate_and_up_equals_the_dense_mlp(data, ranks, target, sequence_parallel, reproduce):
    example = data.draw(examples(target.max_world_size, sequence_parallel), label="example")
    judge = Judge(f"{example}, sequence_parallel={sequence_parallel}", reproduce)
    n, h, f = example.layout.size, example.hidden, example.ffn
    t = dense_layers(example.seed, torch.float64, [(h, 2 * f), (f, h)], example.bias, (*example.leading, h), (*example.leading, h))
    (wgu, bgu), (wd, bd) = t["params"]
    dense = ref.swiglu(t["x"], (wgu, bgu), (wd, bd), t["g"])
    mine = (lambda v, i: tp.sequence_shard(v, n, i)) if sequence_parallel else (lambda v, i: v)
    weights = {"gate_up_weight": wgu, "gate_up_bias": bgu, "down_weight": wd, "down_bias": bd}
    per_member = [
        {
            "layer": "swiglu",
            "dense": weights,
            "options": {"sequence_parallel": sequence_parallel},
            "x": mine(t["x"], i),
            "grad_output": mine(t["g"], i),
        }
        for i in range(n)
    ]
    outputs = judge.run(ranks, example.layout, PROGRAM, per_member)
    shard = " (its sequence shard)" if sequence_parallel else " (full, replicated)"
    notes = {
        "output": shard,
        "grad_input": shard,
        "gate_up_weight": " (rows r of the gate's and of the value's: [gate_r | up_r])",
        "down_bias": " (the whole bias)",
        "grad_down_bias": " (the full gradient on every member)",
    }
    judge_column_then_row(
        judge,
        example.layout,
        outputs,
        dense,
        ("gate_up", wgu, bgu),
        ("down", wd, bd),
        lambda i: ref.gate_up_rows(f, n, i),
        mine,
        notes,
        GATE_AND_UP,
        sequence_parallel,
    )


@pytest.mark.min_ranks(2)
@pytest.mark.capability("tp_swiglu")
@given(data=st.data())
def test_an_ffn_width_that_does_not_split_is_refused(data, ranks, target, reproduce):
    layout = data.draw(layouts(target.max_world_size, min_size=2), label="layout")
    n = layout.size
    ffn = data.draw(st.integers(1, 4 * n).filter(lambda s: s % n), label="ffn")
    hidden = 3
    dense = {
        "gate_up_weight": torch.zeros(2 * ffn, hidden, dtype=torch.float64),
        "gate_up_bias": None,
        "down_weight": torch.zeros(hidden, ffn, dtype=torch.float64),
        "down_bias": None,
    }
    check_refused(Judge(f"{layout}, SwiGLU with ffn={ffn}, h={hidden}", reproduce), ranks, layout, "swiglu", dense, {}, "ffn", ffn)
