"""Conformance of the stage split (``split_stages(model, num_stages)``, CONTRACT.md, "Splitting a
model into stages"): the model's own layers cut into contiguous stages by torch.tensor_split's rule,
judged in the driver against that rule and against the model itself."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.verdict import Judge, run_or_skip
from parallelism_conformance.harness.rank import pipeline_models


def stage_split_rule(num_layers: int, num_stages: int) -> list[list[int]]:
    """The layers each stage holds under the contract's rule: contiguous, in order, the first
    L mod S stages one longer (torch.tensor_split's)."""
    base, longer = divmod(num_layers, num_stages)
    stages, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < longer else 0)
        stages.append(list(range(start, start + size)))
        start += size
    return stages


@pytest.mark.capability("stage_split")
@given(data=st.data())
def test_split_stages_cuts_every_layer_once_in_order(data, ranks, target, request):
    """split_stages(model, S) on a model of L layers, L and S drawn (L not a multiple of S
    included): every layer in exactly one stage, contiguous and in order, the first L mod S stages
    one longer, each stage holding the model's own layers (not copies), and the stages run one
    after another equal to the model, bitwise. Fewer layers than stages: a ValueError naming both
    numbers. (Megatron-LM#1304: 30 layers at PP=4 built 28, silently; torchtitan#963: an uneven
    layer count ignored by the stage split.)"""
    num_layers = data.draw(st.integers(1, 10), label="num_layers")
    num_stages = data.draw(st.integers(1, 6), label="num_stages")
    widths = data.draw(st.lists(st.integers(1, 4), min_size=num_layers + 1, max_size=num_layers + 1), label="widths")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    model = {"widths": widths, "dtype": "float64"}
    inputs = pipeline_models.make_batch(model, 3, seed + 1)["inputs"]
    judge = Judge(f"num_layers={num_layers}, num_stages={num_stages}, widths={widths}, seed={seed}", target.reproduce(request.node.nodeid))
    got = run_or_skip(
        judge, ranks, Layout(1), "pipeline_parallel:split", [{"model": model, "seed": seed, "num_stages": num_stages, "inputs": inputs}]
    )[0]
    if num_stages > num_layers:
        named = got["raised"] == "ValueError" and str(num_layers) in got["message"] and str(num_stages) in got["message"]
        if not named:
            judge.fail(
                f"split_stages of {num_layers} layers into {num_stages} stages returned "
                f"{'stages' if got['raised'] is None else got['raised'] + ': ' + got['message']}; the contract "
                f"asks for a ValueError naming both numbers (a stage would be empty)"
            )
        return
    if got["raised"] is not None:
        judge.fail(f"split_stages raised {got['raised']}: {got['message']}")
    if got["copies"]:
        judge.fail(
            f"split_stages' stages hold {got['copies']} layers that are not the model's own (copies): training "
            "the stages would not train the model"
        )
    want = stage_split_rule(num_layers, num_stages)
    if got["stages"] != want:
        held = sorted(i for stage in got["stages"] for i in stage)
        lost = sorted(set(range(num_layers)) - set(held))
        judge.fail(
            f"split_stages put the model's layers {got['stages']} in its {len(got['stages'])} stages; the "
            f"contract's split is {want} (contiguous, in order, the first L mod S = {num_layers % num_stages} "
            f"stages one longer)" + (f"; layers {lost} are in no stage" if lost else "")
        )
    with torch.no_grad():
        whole = pipeline_models.build(model, seed)(inputs)
    judge.tensor(
        got["chained"],
        whole,
        what="the stages run one after another, against the model itself (the same layers in the same order compute the same bits)",
    )
