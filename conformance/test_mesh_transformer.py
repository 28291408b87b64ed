"""Conformance of the whole block on one mesh (capability ``mesh_transformer``): a small language model,
a tied vocabulary-parallel embedding and head around blocks of tensor-parallel attention and SwiGLU,
on a pp x dp x tp mesh (reference/mesh.py's ``Mesh``), every layer the implementation's
(harness/rank/programs/mesh_transformer.py), against the dense model on the global batch in float64
(reference/transformer_model.py).

What only the whole block shows: the first and the last stage each hold the embedding's rows of
their tensor-parallel shard, the last using them as the head; its gradient is the sum of both uses,
made by ``sync_tied_gradients`` on the pipeline group while the tensor-parallel groups, the
vocabulary-parallel loss's group and the data-parallel groups are live too (Megatron-LM#844: the
embedding's all-reduce in the wrong place), with a vocabulary that need not divide by tp
(Megatron-LM#1754) and attention's fused QKV in either layout (NVIDIA-NeMo/Automodel#1324).

Each test draws the mesh (2 to --max-world-size ranks), a schedule (GPipe or 1F1B), m microbatches,
1-2 blocks per stage, h, the head counts (tp divides the key/value heads), the head width, ffn (a
multiple of tp), the vocabulary (1 to 2 tp + 3), bias, the fused layout, the sequence length and the
samples. In the driver: each replica's loss on its last stage, bitwise equal across that stage's
tensor-parallel group; every rank's gradient shard of every parameter it holds against the dense
model's on the global batch (its rows of the embedding's padded table, its query/key/value heads'
rows in the layout, its columns of the output and down projections, the whole row-parallel biases),
within 1e-8 (1 + |expected|) (float64: layouts and groups, not rounding); the shards bitwise equal
across each data-parallel group, and the embedding's copies on the first and last stage bitwise equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.tensor_parallel as tp_ref
import parallelism_conformance.reference.transformer_layers as layers
import parallelism_conformance.reference.transformer_model as ref
import parallelism_conformance.reference.vocab_parallel as vocab_ref
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.test_mesh_composition import meshes
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.rank import pipeline_models
from parallelism_conformance.reference.mesh import Mesh

PROGRAM = "mesh_transformer:transformer_step"

pytestmark = pytest.mark.capability("mesh_transformer")


@dataclass(frozen=True)
class Example:
    pp: int
    dp: int
    tp: int
    kind: str
    num_microbatches: int
    blocks_per_stage: tuple[int, ...]
    model: dict
    seq: int
    per_replica: int
    seed: int
    data_seed: int

    @property
    def mesh(self) -> Mesh:
        return Mesh(self.pp, self.dp, self.tp)

    def __str__(self) -> str:
        return (
            f"mesh pp={self.pp} x dp={self.dp} x tp={self.tp}, schedule={self.kind}, m={self.num_microbatches}, "
            f"blocks per stage={list(self.blocks_per_stage)}, model={self.model}, seq={self.seq}, "
            f"{self.per_replica} samples per replica, seed={self.seed}, data_seed={self.data_seed}"
        )


@st.composite
def examples(draw, max_world_size: int) -> Example:
    choices = meshes(max_world_size)
    if not choices:
        pytest.skip(f"needs a world of at least 2 ranks; this run draws at most {max_world_size}")
    pp, dp, tp = draw(st.sampled_from(choices), label="mesh (pp, dp, tp)")
    m = draw(st.integers(1, 2), label="m")
    kv_heads = tp * draw(st.integers(1, 2), label="key/value heads per tensor-parallel rank")
    model = {
        "vocab": draw(st.integers(1, 2 * tp + 3), label="vocab"),
        "h": draw(st.integers(1, 4), label="h"),
        "heads": kv_heads * draw(st.integers(1, 2), label="query heads per key/value head"),
        "kv_heads": kv_heads,
        "head_dim": draw(st.integers(1, 2), label="head width"),
        "ffn": tp * draw(st.integers(1, 2), label="ffn per tensor-parallel rank"),
        "bias": draw(st.booleans(), label="bias"),
        "layout": draw(st.sampled_from(["concatenated", "grouped"]), label="qkv layout"),
        "dtype": "float64",
    }
    blocks = tuple(draw(st.lists(st.integers(1, 2), min_size=pp, max_size=pp), label="blocks per stage"))
    model["blocks"] = sum(blocks)
    return Example(
        pp,
        dp,
        tp,
        draw(st.sampled_from(["gpipe", "1f1b"]), label="schedule"),
        m,
        blocks,
        model,
        draw(st.integers(1, 3), label="seq"),
        m * draw(st.integers(1, 2), label="samples per microbatch"),
        draw(st.integers(0, 2**16), label="seed"),
        draw(st.integers(0, 2**16), label="data_seed"),
    )


def tokens(example: Example) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(example.data_seed)
    shape = (example.dp * example.per_replica, example.seq)
    vocab = example.model["vocab"]
    return torch.randint(0, vocab, shape, generator=generator), torch.randint(0, vocab, shape, generator=generator)


def shard(name: str, full: torch.Tensor, model: dict, tp: int, t: int) -> torch.Tensor:
    """What tensor-parallel rank t holds of a parameter (or its gradient): its rows of the padded
    embedding table, its heads' rows of the fused QKV in the layout, its [gate_t | up_t] rows, its
    columns of the output and down projections, and their biases whole."""
    if name == "embed.weight":
        return vocab_ref.padded_rows(full, tp, t)
    layer, kind = name.split(".")[-2:]
    if layer == "qkv":
        d = model["head_dim"]
        return layers.rows_of(full, layers.qkv_rows(model["layout"], model["heads"], model["kv_heads"], d, tp, t))
    if layer == "gate_up":
        return layers.rows_of(full, layers.gate_up_rows(model["ffn"], tp, t))
    return tp_ref.chunk(full, 1, tp, t) if kind == "weight" else full


def stage_names(example: Example, s: int, names) -> list[str]:
    first = sum(example.blocks_per_stage[:s])
    mine = {f"blocks.{b}." for b in range(first, first + example.blocks_per_stage[s])}
    return sorted(n for n in names if any(n.startswith(prefix) for prefix in mine) or (n == "embed.weight" and s in (0, example.pp - 1)))


@given(data=st.data())
def test_the_whole_block_on_a_pp_dp_tp_mesh_matches_the_dense_model(data, ranks, target, reproduce):
    example = data.draw(examples(target.max_world_size), label="example")
    mesh, m = example.mesh, example.num_microbatches
    inputs, targets = tokens(example)
    rows = [torch.tensor_split(inputs, example.dp), torch.tensor_split(targets, example.dp)]
    common = {
        "model": example.model,
        "seed": example.seed,
        "blocks_per_stage": list(example.blocks_per_stage),
        "num_microbatches": m,
        "schedule": example.kind,
        "mesh": {axis: mesh.groups(axis) for axis in ("pp", "dp", "tp")},
    }
    per_rank = []
    for rank in range(mesh.world_size):
        s, d, _ = mesh.coordinates(rank)
        per_rank.append({**common, "inputs": rows[0][d] if s == 0 else None, "targets": rows[1][d] if s == example.pp - 1 else None})
    judge = Judge(str(example), reproduce)
    outputs = judge.run(ranks, Layout(mesh.world_size), PROGRAM, per_rank)
    params = {name: p.detach() for name, p in pipeline_models.build_transformer(example.model, example.seed).named_parameters()}
    _, grads = ref.loss_and_grads(params, inputs, targets, example.model)
    for rank in range(mesh.world_size):
        s, d, t = mesh.coordinates(rank)
        where = f"rank {rank} (stage {s}, replica {d}, tensor-parallel shard {t})"
        got = outputs[rank]
        if got.get("stage") != s:
            judge.fail(
                f"{where}: the rank program ran stage {got.get('stage')} of its pipeline group {mesh.group_of('pp', rank)}, expected {s}"
            )
        if s == example.pp - 1:
            loss, _ = ref.loss_and_grads(params, rows[0][d], rows[1][d], example.model)
            judge.tensor(
                got["loss"], loss, atol=layers.atol(loss), what=f"{where} loss: replica {d}'s mean cross entropy over its {m} microbatches"
            )
        elif got["loss"] is not None:
            judge.fail(f"{where} returned a loss; only a pipeline's last stage does")
        for name in stage_names(example, s, grads):
            key = f"stage{s}.{name}"
            if got["grads"].get(key) is None:
                judge.fail(f"{where}: '{name}' has no gradient")
            want = shard(name, grads[name], example.model, example.tp, t)
            note = " (the sum of its uses as the embedding and the head)" if name == "embed.weight" else ""
            judge.tensor(
                got["grads"][key],
                want,
                atol=layers.atol(want),
                what=f"{where} gradient of '{name}'{note}: its tensor-parallel shard, averaged over "
                f"data-parallel group {mesh.group_of('dp', rank)}",
            )
    for group in mesh.groups("dp"):
        s = mesh.coordinates(group[0])[0]
        for name in stage_names(example, s, grads):
            judge.bitwise_identical(
                {rank: outputs[rank]["grads"][f"stage{s}.{name}"] for rank in group},
                what=f"gradient shard '{name}' across data-parallel group {group}",
            )
    for group in mesh.groups("pp"):
        holders = {rank: outputs[rank]["grads"][f"stage{mesh.coordinates(rank)[0]}.embed.weight"] for rank in (group[0], group[-1])}
        judge.bitwise_identical(holders, what=f"the tied embedding's gradient on the first and last stage {list(holders)}")
    for group in mesh.groups("tp"):
        if mesh.coordinates(group[0])[0] == example.pp - 1:
            judge.bitwise_identical(
                {rank: outputs[rank]["loss"] for rank in group}, what=f"loss across the last stage's tensor-parallel group {group}"
            )
