"""Conformance of tensor parallelism (ColumnParallelLinear, RowParallelLinear, TensorParallelMLP,
the contract in harness/rank/programs/tensor_parallel.py), against reference/tensor_parallel.py.

Each test draws an example (world size, half the time a subgroup of it; feature widths, multiples
of the group size n where the layout splits them; 0-2 extra leading dims of the input; bias on or
off; float32 or float64), builds the dense weights in the driver and sends them to every member,
with each member's slice of the input and of the upstream gradient. The ranks wrap the dense layer,
run forward and backward (harness/rank/programs/tensor_parallel.py) and return the output, the input
gradient, their shards and the shards' gradients. In the driver, member by member:

* the shard each rank keeps is exactly its chunk of the dense weight (and bias);
* the output, the input gradient and each shard's weight and bias gradients equal the reference's
  slices for that rank and layout, within reference.tensor_parallel.linear_atol / mlp_atol
  (C (K + n + 2) u times the matching sum of absolute values, K the reduction length);
* the row layer's bias gradient is the full dL/db on every rank (not n times it), its bias added
  once to the output;
* what every member holds whole (the row layer's output and bias gradient, the column layer's
  input gradient and gathered output, the MLP's output and input gradient) is bitwise identical on
  every member; the MLP, and the MLP with sequence parallelism, equal the dense MLP forward
  and backward;
* sizes that do not split raise a ValueError naming the dimension, its size and the group size.

bfloat16 and float16 are not drawn for the value tests: with u = 2^-8 the bound for a reduction of
K terms is about K/64 of the sizes involved, loose enough to let a bias added n times pass; a
dedicated test draws them on examples whose results are exact (zero input, integer gradients), and
checks where the bias enters. A class that is missing or raises
NotImplementedError fails these tests as "not implemented" (CONTRACT.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.likely_bugs as likely_bugs
import parallelism_conformance.reference.tensor_parallel as ref
from parallelism_conformance.conformance.examples import layouts
from parallelism_conformance.conformance.tensor_parallel_examples import DTYPES, Example, examples
from parallelism_conformance.conformance.tp_refusals import judge_refusals
from parallelism_conformance.conformance.verdict import Judge

PROGRAM = "tensor_parallel:forward_backward"


def judge_member(judge: Judge, rank: int, got: dict, expected: dict, atol: dict, notes: dict, suspects: dict | None = None) -> None:
    """``expected``: {key: tensor or None}; parameter values (no atol entry) must match exactly.
    ``suspects``: {key: callable returning known wrong answers} (reference/likely_bugs.py)."""
    for key, want in expected.items():
        what = f"rank {rank} {key.replace('_', ' ')}{notes.get(key, '')}"
        if key not in got:
            judge.fail(f"{what}: the rank program returned no '{key}'")
        if want is None:
            if got[key] is not None:
                judge.fail(f"{what}: expected None (the layer has no bias), got {type(got[key]).__name__}")
            continue
        judge.tensor(got[key], want, what=what, atol=atol.get(key), suspects=(suspects or {}).get(key))


def judge_replicated(judge: Judge, outputs: dict, keys: list[str]) -> None:
    """Results every member holds whole (all-reduced, all-gathered, or computed from replicated
    inputs) must be bitwise identical on every member, or replicas drift apart."""
    for key in keys:
        if all(isinstance(out.get(key), torch.Tensor) for out in outputs.values()):
            judge.bitwise_identical({rank: out[key] for rank, out in outputs.items()}, what=key.replace("_", " "))


# ----------------------------------------------------------------------------------- the layers
@pytest.mark.capability("tensor_parallel")
@pytest.mark.parametrize("gather_output", [False, True], ids=["sharded_output", "gather_output"])
@given(data=st.data())
def test_column_parallel_linear(data, ranks, target, gather_output, reproduce):
    example = data.draw(examples(target.max_world_size, "out"), label="example")
    judge = Judge(f"{example}, gather_output={gather_output}", reproduce)
    t, n = example.tensors(), example.n
    (weight, bias), x, g = t["params"][0], t["x"], t["g"]
    dense, atol = ref.linear(x, weight, bias, g), ref.linear_atol(x, weight, bias, g, n)
    per_member = [
        {
            "layer": "column",
            "dense": {"weight": weight, "bias": bias},
            "options": {"gather_output": gather_output},
            "x": x,
            "grad_output": g if gather_output else ref.features_shard(g, n, i),
        }
        for i in range(n)
    ]
    outputs = judge.run(ranks, example.layout, PROGRAM, per_member)
    notes = {
        "output": " (the full output)" if gather_output else " (its slice of the output features)",
        "grad_input": " (the full dL/dx: f all-reduces it in backward)",
    }
    for i, rank in enumerate(example.layout.ranks):
        w, b = ref.column_shard(weight, bias, n, i)
        gw, gb = ref.column_shard(dense["grad_weight"], dense.get("grad_bias"), n, i)
        aw, ab = ref.column_shard(atol["grad_weight"], atol.get("grad_bias"), n, i)
        out_of = (lambda t: t) if gather_output else (lambda t: ref.features_shard(t, n, i))
        expected = {
            "weight": w,
            "bias": b,
            "output": out_of(dense["output"]),
            "grad_input": dense["grad_input"],
            "grad_weight": gw,
            "grad_bias": gb,
        }
        tol = {"output": out_of(atol["output"]), "grad_input": atol["grad_input"], "grad_weight": aw, "grad_bias": ab}
        judge_member(judge, rank, outputs[rank], expected, tol, notes)
    judge_replicated(judge, outputs, ["grad_input", *(["output"] if gather_output else [])])


@pytest.mark.capability("tensor_parallel")
@pytest.mark.parametrize("input_is_parallel", [True, False], ids=["parallel_input", "full_input"])
@given(data=st.data())
def test_row_parallel_linear(data, ranks, target, input_is_parallel, reproduce):
    example = data.draw(examples(target.max_world_size, "in"), label="example")
    judge = Judge(f"{example}, input_is_parallel={input_is_parallel}", reproduce)
    t, n = example.tensors(), example.n
    (weight, bias), x, g = t["params"][0], t["x"], t["g"]
    dense, atol = ref.linear(x, weight, bias, g), ref.linear_atol(x, weight, bias, g, n)
    per_member = [
        {
            "layer": "row",
            "dense": {"weight": weight, "bias": bias},
            "options": {"input_is_parallel": input_is_parallel},
            "x": ref.features_shard(x, n, i) if input_is_parallel else x,
            "grad_output": g,
        }
        for i in range(n)
    ]
    outputs = judge.run(ranks, example.layout, PROGRAM, per_member)
    notes = {
        "output": " (the full output: partial outputs all-reduced, the bias added once)",
        "grad_input": " (its slice of dL/dx)" if input_is_parallel else " (the full dL/dx)",
        "grad_bias": " (the full dL/db on every rank, not n times it)",
    }
    for i, rank in enumerate(example.layout.ranks):
        w, b = ref.row_shard(weight, bias, n, i)
        gw, gb = ref.row_shard(dense["grad_weight"], dense.get("grad_bias"), n, i)
        aw, ab = ref.row_shard(atol["grad_weight"], atol.get("grad_bias"), n, i)
        in_of = (lambda t: ref.features_shard(t, n, i)) if input_is_parallel else (lambda t: t)
        expected = {
            "weight": w,
            "bias": b,
            "output": dense["output"],
            "grad_input": in_of(dense["grad_input"]),
            "grad_weight": gw,
            "grad_bias": gb,
        }
        tol = {"output": atol["output"], "grad_input": in_of(atol["grad_input"]), "grad_weight": aw, "grad_bias": ab}
        judge_member(
            judge,
            rank,
            outputs[rank],
            expected,
            tol,
            notes,
            suspects={"output": lambda: likely_bugs.row_parallel_output(dense["output"], bias, n, atol["output"])},
        )
    judge_replicated(judge, outputs, ["output", "grad_bias", *([] if input_is_parallel else ["grad_input"])])


# -------------------------------------------------------------------------------------- the MLP
def check_mlp(judge: Judge, ranks, example: Example, sequence_parallel: bool) -> None:
    t, n = example.tensors(), example.n
    (w1, b1), (w2, b2) = t["params"]
    x, g = t["x"], t["g"]
    if example.norm:  # the pre-norm block: LayerNorm, then the MLP
        dense = ref.normed_mlp(x, t["norm"], (w1, b1), (w2, b2), g)
        atol = ref.normed_mlp_atol(x, t["norm"], (w1, b1), (w2, b2), g, n)
    else:
        dense, atol = ref.mlp(x, (w1, b1), (w2, b2), g), ref.mlp_atol(x, (w1, b1), (w2, b2), g, n)
    mine = (lambda t, i: ref.sequence_shard(t, n, i)) if sequence_parallel else (lambda t, i: t)
    weights = {"fc1_weight": w1, "fc1_bias": b1, "fc2_weight": w2, "fc2_bias": b2}
    if example.norm:
        weights.update(norm_weight=t["norm"][0], norm_bias=t["norm"][1], norm_eps=t["norm"][2])
    per_member = [
        {"layer": "mlp", "dense": weights, "options": {"sequence_parallel": sequence_parallel}, "x": mine(x, i), "grad_output": mine(g, i)}
        for i in range(n)
    ]
    outputs = judge.run(ranks, example.layout, PROGRAM, per_member)
    shard = " (its sequence shard)" if sequence_parallel else " (full, replicated)"
    whole = ", over the whole sequence)" if sequence_parallel else ")"
    notes = {
        "output": shard,
        "grad_input": shard,
        "fc2_bias": " (the whole bias)",
        "grad_fc2_bias": " (the full dL/db2 on every rank" + whole,
        "grad_norm_weight": " (the LayerNorm's, whole on every rank: the full gradient" + whole,
        "grad_norm_bias": " (the LayerNorm's, whole on every rank: the full gradient" + whole,
    }
    for i, rank in enumerate(example.layout.ranks):
        expected = {"output": mine(dense["output"], i), "grad_input": mine(dense["grad_input"], i)}
        tol = {"output": mine(atol["output"], i), "grad_input": mine(atol["grad_input"], i)}
        for prefix, split, (w, b) in (("fc1_", ref.column_shard, (w1, b1)), ("fc2_", ref.row_shard, (w2, b2))):
            expected[prefix + "weight"], expected[prefix + "bias"] = split(w, b, n, i)
            gw, gb = split(dense["grad_" + prefix + "weight"], dense.get("grad_" + prefix + "bias"), n, i)
            expected["grad_" + prefix + "weight"], expected["grad_" + prefix + "bias"] = gw, gb
            tol["grad_" + prefix + "weight"], tol["grad_" + prefix + "bias"] = split(
                atol["grad_" + prefix + "weight"], atol.get("grad_" + prefix + "bias"), n, i
            )
        suspects = {
            "output": lambda: likely_bugs.row_parallel_output(
                expected["output"], mine(b2.expand_as(dense["output"]), i) if b2 is not None else None, n, tol["output"]
            )
        }
        if example.norm:
            for key in ("norm_weight", "norm_bias"):
                expected[key] = t["norm"][0] if key == "norm_weight" else t["norm"][1]
                expected["grad_" + key], tol["grad_" + key] = dense["grad_" + key], atol["grad_" + key]
                suspects["grad_" + key] = lambda key=key: likely_bugs.replicated_gradient(
                    dense["grad_" + key], atol["grad_" + key], n, sequence_parallel
                )
        judge_member(judge, rank, outputs[rank], expected, tol, notes, suspects=suspects)
    judge_replicated(
        judge,
        outputs,
        [
            "grad_fc2_bias",
            *(["grad_norm_weight", "grad_norm_bias"] if example.norm else []),
            *([] if sequence_parallel else ["output", "grad_input"]),
        ],
    )


@pytest.mark.capability("tensor_parallel")
@given(data=st.data())
def test_mlp_equals_the_dense_mlp(data, ranks, target, reproduce):
    example = data.draw(examples(target.max_world_size, "ffn"), label="example")
    check_mlp(Judge(str(example), reproduce), ranks, example, sequence_parallel=False)


@pytest.mark.capability("tensor_parallel")
@given(data=st.data())
def test_sequence_parallel_mlp_equals_the_dense_mlp(data, ranks, target, reproduce):
    example = data.draw(examples(target.max_world_size, "sequence"), label="example")
    check_mlp(Judge(f"{example}, sequence_parallel=True", reproduce), ranks, example, sequence_parallel=True)


# --------------------------------------------------------------------------- sizes that do not split
REFUSED_DIMENSION = {
    "column": ("out_features", "out_features"),
    "row": ("in_features", "in_features"),
    "mlp": ("ffn", "the ffn width (fc1.out_features)"),
}


LOW_PRECISION = (torch.bfloat16, torch.float16)


@pytest.mark.capability("tensor_parallel")
@pytest.mark.parametrize("layer", ["row", "mlp", "mlp_sp"])
@given(data=st.data())
def test_the_bias_enters_once_in_low_precision(data, ranks, target, layer, reproduce):
    """bfloat16 and float16, where the value bounds are too loose to see a bias added n times, with
    an example in which every result is exact: the input is zero (and for the MLP the first bias
    too, so its hidden activation is GELU(0) = 0), so the output is the last bias exactly, once; the
    upstream gradient holds small integers, so the last bias's gradient, their sum over the rows,
    is exact too. Any other value is a structural error: the bias entered n times, or not at all."""
    dtype = data.draw(st.sampled_from(LOW_PRECISION), label="dtype")
    example = data.draw(examples(target.max_world_size, {"row": "in", "mlp": "ffn", "mlp_sp": "sequence"}[layer]), label="example")
    judge = Judge(f"{example} (as {str(dtype).removeprefix('torch.')}, zero input, integer upstream gradient)", reproduce)
    t, n = example.tensors(), example.n
    g = torch.Generator().manual_seed(example.seed)
    w_last, out_features = t["params"][-1][0], t["g"].shape[-1]
    bias = torch.randint(-8, 9, (out_features,), generator=g).to(dtype) / 8  # exact in both dtypes
    x = torch.zeros(t["x"].shape, dtype=dtype)
    grad = torch.randint(-3, 4, t["g"].shape, generator=g).to(dtype)
    rows = grad.reshape(-1, out_features)
    if layer == "row":
        dense = {"weight": w_last.to(dtype), "bias": bias}
        per_member = [
            {"layer": "row", "dense": dense, "options": {"input_is_parallel": True}, "x": ref.features_shard(x, n, i), "grad_output": grad}
            for i in range(n)
        ]
        keys = ("output", "grad_bias")
    else:
        (w1, _), sp = t["params"][0], layer == "mlp_sp"
        dense = {
            "fc1_weight": w1.to(dtype),
            "fc1_bias": torch.zeros(w1.shape[0], dtype=dtype),
            "fc2_weight": w_last.to(dtype),
            "fc2_bias": bias,
        }
        mine = (lambda v, i: ref.sequence_shard(v, n, i)) if sp else (lambda v, i: v)
        per_member = [
            {"layer": "mlp", "dense": dense, "options": {"sequence_parallel": sp}, "x": mine(x, i), "grad_output": mine(grad, i)}
            for i in range(n)
        ]
        keys = ("output", "grad_fc2_bias")
    outputs = judge.run(ranks, example.layout, PROGRAM, per_member)
    for i, rank in enumerate(example.layout.ranks):
        got = outputs[rank]
        want_out = bias.expand(*(per_member[i]["x"].shape[:-1]), out_features)
        judge.tensor(
            got[keys[0]],
            want_out,
            what=f"rank {rank} output (exactly the bias, added once: the input is zero)",
            suspects=lambda: [(f"the bias added {n} times: every rank adds it before the reduction", want_out * n, None)],
        )
        total = rows.to(torch.float64).sum(0).to(dtype)
        judge.tensor(
            got[keys[1]],
            total,
            what=f"rank {rank} {keys[1].replace('_', ' ')} (the sum of the integer upstream gradient over every row, exact)",
        )


@pytest.mark.min_ranks(2)
@pytest.mark.capability("tensor_parallel")
@pytest.mark.parametrize("layer", ["column", "row", "mlp"])
@given(data=st.data())
def test_a_width_that_does_not_split_is_refused(data, ranks, target, layer, reproduce):
    """from_dense raises a ValueError naming the dimension, its size and the group size."""
    layout = data.draw(layouts(target.max_world_size, min_size=2), label="layout")
    n = layout.size
    size = data.draw(st.integers(1, 4 * n).filter(lambda s: s % n), label="size")
    other = data.draw(st.integers(1, 6), label="other width")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    judge = Judge(f"{layout}, {layer} with {REFUSED_DIMENSION[layer][1]} = {size}, {str(dtype).removeprefix('torch.')}", reproduce)
    shape = {"column": (size, other), "row": (other, size)}
    if layer == "mlp":
        dense = {
            "fc1_weight": torch.zeros(size, other, dtype=dtype),
            "fc1_bias": None,
            "fc2_weight": torch.zeros(other, size, dtype=dtype),
            "fc2_bias": None,
        }
        x = torch.zeros(2, other, dtype=dtype)
    else:
        dense = {"weight": torch.zeros(shape[layer], dtype=dtype), "bias": None}
        x = torch.zeros(2, shape[layer][1] if layer == "column" else other, dtype=dtype)
    outputs = judge.run(ranks, layout, "tensor_parallel:refusal", [{"layer": layer, "dense": dense, "options": {}, "x": x} for _ in range(n)])
    judge_refusals(judge, outputs, layout, f"{layer} layer with {REFUSED_DIMENSION[layer][1]} = {size}", REFUSED_DIMENSION[layer][0], size)


@pytest.mark.capability("tp_norm")
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated_input", "sequence_parallel"])
@given(data=st.data())
def test_a_layernorm_before_the_mlp_keeps_whole_gradients(data, ranks, target, sequence_parallel, reproduce):
    """TensorParallelMLP.from_dense(fc1, fc2, group, sequence_parallel, norm=LayerNorm(h)): the
    pre-norm block against the dense one in float64, the LayerNorm's weight and bias whole on every
    member and their gradients the full ones, bitwise the same on every member. Under sequence
    parallelism the norm sees a sequence shard, so its gradients must be all-reduced
    (Megatron-LM#1446, gpt-neox#1257: LayerNorm gradients that differ per rank)."""
    example = data.draw(examples(target.max_world_size, "sequence" if sequence_parallel else "ffn"), label="example")
    example = dataclasses.replace(example, norm=True)
    check_mlp(Judge(f"{example}, sequence_parallel={sequence_parallel}", reproduce), ranks, example, sequence_parallel=sequence_parallel)
