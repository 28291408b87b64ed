"""Conformance of a loss normalised by the global token count on a pp x dp mesh (capability
``dp_pp_token_loss``): data parallelism over pipelines (conformance/test_pipeline_composition.py's
mesh and examples) where the loss is the sum of the squared errors over the valid rows of the
whole global batch divided by their count C (padding rows' targets NaN; some replicas and
microbatches hold none).

Only a pipeline's last stage holds targets, so the last stages count: each calls the
implementation's ``global_token_count(its valid rows, group=its data-parallel group)``, a group that
is not the world and whose members are not consecutive ranks; every pipeline runs
``pipeline_step(..., scale_grads=False, group=its pipeline)`` with loss_fn = the summed error / C, and
the harness sums each stage gradient over its data-parallel group with ``all_reduce`` (no 1/dp:
the loss is already the global mean) (harness/rank/programs/pipeline_parallel.py, ``dp_pp_step``).

Checked: every last stage's count is C; replica d's loss is the dense model's sum over its rows
divided by C; every stage gradient is the dense model's on the global batch (reference/
pipeline_parallel.py, dp m microbatches), bitwise equal across its data-parallel group. A count
over one replica (NVIDIA-NeMo/Automodel#3830: gradients dp times the global mean), over the world
instead of the group, or a pipeline that still divides by m (torchtitan#2972) fails here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.pipeline_parallel as ref
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.test_pipeline_composition import PROGRAM, Example, examples, judge_stage_gradients
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.rank import pipeline_models
from parallelism_conformance.reference import mesh


@dataclasses.dataclass(frozen=True)
class PaddedExample:
    mesh: Example
    padded: tuple[int, ...]  # rows of the global batch whose targets are padding

    def __str__(self) -> str:
        return f"{self.mesh}, padded rows {list(self.padded)} (the summed error over the valid rows / their count)"

    def batch(self) -> dict:
        example = self.mesh
        batch = pipeline_models.make_batch(example.model, example.dp * example.per_replica, example.data_seed)
        batch["targets"][list(self.padded)] = float("nan")
        return batch


@st.composite
def padded_examples(draw, max_world_size: int) -> PaddedExample:
    example = draw(examples(max_world_size), label="mesh example")
    rows = example.dp * example.per_replica
    padded = draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=rows - 1), label="padded rows")
    return PaddedExample(example, tuple(sorted(padded)))


def _stages(example: Example):
    return pipeline_models.split(pipeline_models.build(example.model, example.seed), list(example.layers_per_stage))


@pytest.mark.capability("dp_pp_token_loss")
@given(data=st.data())
def test_pipelines_over_data_parallel_replicas_normalise_by_the_global_count(data, ranks, target, reproduce):
    padded = data.draw(padded_examples(target.max_world_size), label="example")
    example, batch = padded.mesh, padded.batch()
    pp, dp, m = example.pp, example.dp, example.num_microbatches
    pipelines, replicas = mesh.pipeline_mesh(pp, dp)
    rows = [torch.tensor_split(batch[key], dp) for key in ("inputs", "targets")]
    common = {
        "model": example.model,
        "seed": example.seed,
        "layers_per_stage": list(example.layers_per_stage),
        "num_microbatches": m,
        "loss": "masked_sum",
        "pipeline_groups": pipelines,
        "data_parallel_groups": replicas,
        "schedule": example.kind,
        "per_token": True,
    }
    per_rank = []
    for rank in range(pp * dp):
        s, d = divmod(rank, dp)
        per_rank.append({**common, "inputs": rows[0][d] if s == 0 else None, "targets": rows[1][d] if s == pp - 1 else None})
    judge = Judge(str(padded), reproduce)
    outputs = judge.run(ranks, Layout(pp * dp), PROGRAM, per_rank)
    count = pipeline_models.valid_rows(batch["targets"])

    def per_token(output, target):
        return pipeline_models.masked_squared_error(output, target) / count

    whole = ref.dense_step(_stages(example), batch["inputs"], batch["targets"], per_token, dp * m, scale_grads=False)
    for rank in replicas[pp - 1]:  # the counts first: a wrong one explains every number after it
        d = rank - (pp - 1) * dp
        if outputs[rank].get("count") != count:
            judge.fail(
                f"rank {rank} (last stage of replica {d}): global_token_count(its "
                f"{pipeline_models.valid_rows(rows[1][d])} valid rows, group={replicas[pp - 1]}) returned "
                f"{outputs[rank].get('count')}; the valid rows of the whole global batch are {count} (the sum "
                "over its data-parallel group)"
            )
    for rank in range(pp * dp):
        s, d = divmod(rank, dp)
        got = outputs[rank]
        if s == pp - 1:
            mine = ref.dense_step(_stages(example), rows[0][d], rows[1][d], per_token, m, scale_grads=False)
            judge.tensor(
                got["loss"],
                mine.loss,
                atol=mine.loss_atol,
                what=f"rank {rank} (last stage of replica {d}) loss: its rows' summed error over the global "
                f"count {count} (scale_grads=False: no 1/m)",
            )
    judge_stage_gradients(judge, outputs, whole, pp, dp, replicas, "summed over", f", every valid row weighing 1/{count}")
