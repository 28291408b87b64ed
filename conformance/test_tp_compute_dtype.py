"""Conformance of a compute dtype in tensor parallelism (capability ``tp_compute_dtype``):
``TensorParallelMLP.from_dense(fc1, fc2, group, sequence_parallel=True, compute_dtype=d)``, d bfloat16 or
float16, the parameters float32 masters.

Reported bug this is for: pytorch#190626 (FSDP2's reduce_dtype=float32 was not applied to the
tensor-parallel gradient all-reduce, which ran in bfloat16). Under sequence parallelism one parameter
gradient is summed across the group: the row layer's bias meets one sequence shard per member, so its
gradient is each member's partial sum, all-reduced. Summed in d, it rounds; in the masters' dtype, it
does not. Nothing shows in a loss curve.

Each example is built so that everything but that sum is exact in d (the pattern of
``test_the_bias_enters_once_in_low_precision``): the input is zero and fc1's bias too, so the hidden
activation is GELU(0) = 0 and the output is fc2's bias, k/8, exactly; the upstream gradient is zero but
for one row of each member's sequence shard, +-(2^(p+1) - 1) on the first member and +-2 on the others
(p: d's mantissa bits, so each partial sum is exact in d) whose sum, odd and past 2^(p+1), is not. In the
driver, member by member: the output in d and exactly the bias; fc2's bias gradient float32 and exactly
the sum; every parameter and gradient float32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.tensor_parallel as ref
from parallelism_conformance.conformance.tensor_parallel_examples import examples
from parallelism_conformance.conformance.test_tensor_parallel import PROGRAM
from parallelism_conformance.conformance.verdict import Judge, run_or_skip

# the largest odd integer every member's partial sum may be: exact in d (2^(p+1) - 1, p mantissa bits)
LARGEST_EXACT = {torch.bfloat16: 255, torch.float16: 2047}
PARAMETERS = ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")


@pytest.mark.capability("tp_compute_dtype")
@given(data=st.data())
def test_the_sequence_parallel_bias_gradient_is_summed_in_the_masters_dtype(data, ranks, target, reproduce):
    dtype = data.draw(st.sampled_from(list(LARGEST_EXACT)), label="compute dtype")
    example = dataclasses.replace(
        data.draw(examples(target.max_world_size, "sequence", min_size=2), label="example"), bias=True
    )  # fc2's bias is the point; fc1's is zero
    judge = Judge(
        f"{example} (float32 masters, compute_dtype={str(dtype).removeprefix('torch.')}, sequence "
        "parallel, zero input, one nonzero upstream row per member)",
        reproduce,
    )
    built = bias_sum_example(example, dtype)
    judge_bias_sum(judge, example, built, run_or_skip(judge, ranks, example.layout, PROGRAM, built["per_member"]))


def bias_sum_example(example, dtype: torch.dtype) -> dict:
    """The example of the module docstring: {"per_member": the rank program's inputs, "dtype",
    "bias": fc2's float32 bias, "total": the float32 sum of the upstream gradient's rows, "x"}."""
    n, t = example.n, example.tensors()
    (w1, _), (w2, _) = t["params"]
    g = torch.Generator().manual_seed(example.seed)
    h = example.in_features
    bias = torch.randint(-8, 9, (h,), generator=g).float() / 8  # exact in both dtypes
    signs = torch.randint(0, 2, (h,), generator=g).float() * 2 - 1
    x = torch.zeros((*example.leading, h), dtype=torch.float32)
    grad = torch.zeros(x.shape, dtype=torch.float32)
    per_rank = x.shape[-2] // n
    leading = (0,) * (x.dim() - 2)
    for i in range(n):
        grad[(*leading, i * per_rank)] = signs * (LARGEST_EXACT[dtype] if i == 0 else 2)
    dense = {"fc1_weight": w1.float(), "fc1_bias": torch.zeros(w1.shape[0]), "fc2_weight": w2.float(), "fc2_bias": bias}
    per_member = [
        {
            "layer": "mlp",
            "dense": dense,
            "options": {"sequence_parallel": True, "compute_dtype": dtype},
            "x": ref.sequence_shard(x, n, i),
            "grad_output": ref.sequence_shard(grad, n, i).to(dtype),
        }
        for i in range(n)
    ]
    # odd and past the exact range: only a float32 sum keeps it
    return {"per_member": per_member, "dtype": dtype, "bias": bias, "total": grad.reshape(-1, h).sum(0), "x": x}


def judge_bias_sum(judge: Judge, example, built: dict, outputs: dict) -> None:
    dtype, total, n = built["dtype"], built["total"], example.n
    for i, rank in enumerate(example.layout.ranks):
        got = outputs[rank]
        want = built["bias"].to(dtype).expand(*ref.sequence_shard(built["x"], n, i).shape)
        judge.tensor(got["output"], want, what=f"rank {rank} output (in the compute dtype: exactly fc2's bias, the input being zero)")
        for name in PARAMETERS:
            for key in (name, "grad_" + name):
                if got.get(key) is not None and got[key].dtype != torch.float32:
                    judge.fail(f"rank {rank} {key.replace('_', ' ')} is {got[key].dtype}: the masters and their gradients stay float32")
        judge.tensor(
            got["grad_fc2_bias"],
            total,
            what=f"rank {rank} grad fc2 bias (every member's partial sum, summed across the group in float32)",
            suspects=lambda: [
                (f"summed across the group in {str(dtype).removeprefix('torch.')} (pytorch#190626)", total.to(dtype).float(), None)
            ],
        )
