"""Conformance of a weight tied across pipeline stages (capability ``pipeline_tied``): the model's last
layer uses the first layer's weight (transposed), as a language model's output head uses its
embedding, so the first and the last stage each hold a copy. After the step's pipeline_step calls
the harness calls the implementation's ``sync_tied_gradients(stages, tied)``; then every copy's
gradient must be the dense model's gradient of the one weight, the sum of both uses, and the
copies bitwise identical, so that the optimizer keeps them equal.

Examples: the pipeline tests' (conformance/test_pipeline_parallel.py) with the loop placement
(GPipe, 1F1B, interleaved and random valid schedules; p = 1-4, v = 1-2, m = 1-8), widths
w0, w1, ..., w1, w0 so that the last layer can use the first's weight, one or two pipeline_step
calls before the synchronisation. With p = 1 both uses are on one rank, in one Parameter listed by
two stages (or twice by one): autograd has already summed them, and adding them again counts the
weight twice. Judged with judge_step against reference/pipeline_parallel.py's dense model, where
the weight is one tensor.

Reported bugs this is for: Megatron-LM#844 (the distributed optimizer reduce-scattered before the
embedding's all-reduce, so the tied copies were updated from partial gradients) and copies that
drift apart when one of them is never given the other's gradient.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import parallelism_conformance.reference.data_parallel as ref_dp
from parallelism_conformance.conformance.test_grad_clipping import MAX_NORM_FACTORS, NORM_TYPES, judge_pipeline_clipping
from parallelism_conformance.conformance.test_pipeline_parallel import Example, dense, examples, judge_step, run_step
from parallelism_conformance.conformance.verdict import Judge

LOOP_KINDS = ("gpipe", "1f1b", "interleaved", "random")
TIED_ONCE = "a weight tied across stages counts once (the copies hold one weight's gradient)"


@st.composite
def tied_examples(draw, max_ranks: int) -> Example:
    """A loop-placement pipeline example whose model can tie its last layer to its first: at least
    two layers, widths w0, w1, ..., w1, w0."""
    example = draw(examples(max_ranks, kinds=LOOP_KINDS), label="example")
    layers = list(example.layers_per_stage)
    if sum(layers) < 2:
        layers[-1] += 1
    widths = list(example.widths)[: sum(layers) + 1]
    widths += [widths[-1]] * (sum(layers) + 1 - len(widths))
    widths[-1], widths[-2] = widths[0], widths[1]
    return dataclasses.replace(
        example, layers_per_stage=tuple(layers), widths=tuple(widths), calls=draw(st.integers(1, 2), label="pipeline_step calls"), tied=True
    )


@pytest.mark.capability("pipeline_tied")
@given(data=st.data())
def test_a_weight_tied_across_stages_gets_the_sum_of_both_uses_on_every_copy(data, ranks, target, request):
    example = data.draw(tied_examples(target.max_world_size), label="tied example")
    event(f"{example.kind}, p={example.num_ranks}, v={example.stages_per_rank}")
    judge = Judge(str(example), target.reproduce(request.node.nodeid))
    outputs = run_step(judge, ranks, example)
    copies = {}  # what each holder reports of the tied weight's gradient, by rank and stable name
    p = example.num_ranks
    # with one stage, both uses are one parameter of that stage (named_parameters lists it once)
    for stage, name in example.tied_copies()[: 1 if len(example.layers_per_stage) == 1 else 2]:
        key = f"stage{stage}.{name}"
        got = outputs[stage % p]["grads"].get(key)
        if not isinstance(got, torch.Tensor):
            judge.fail(f"rank {stage % p}: the tied weight's copy '{key}' has no gradient after sync_tied_gradients")
        copies[(stage % p, key)] = got
    judge_step(judge, example, outputs)
    (first_at, first), (last_at, last) = list(copies.items())[0], list(copies.items())[-1]
    if not torch.equal(first, last):
        judge.fail(
            f"the tied weight's copies differ after sync_tied_gradients: '{first_at[1]}' on rank {first_at[0]} "
            f"and '{last_at[1]}' on rank {last_at[0]} (largest difference {(first - last).abs().max().item():.3g}); "
            "the optimizer would move them apart"
        )


@pytest.mark.capability("pipeline_tied")
@given(data=st.data())
def test_the_tied_weight_counts_once_in_the_clipped_norm(data, ranks, target, request):
    """After sync_tied_gradients, clip_grad_norm_(stages, max_norm, norm_type, pp_group, tied=the
    same uses): the norm is the dense model's, where the tied weight is one tensor, so its copies
    count once (Megatron-LM#7227: the embedding and the head counted twice, the norm sqrt(2) times
    too large and every step over-clipped), bitwise the same on every rank, and every stage's
    gradients are the dense ones times min(1, max_norm / (N + 1e-6))."""
    example = dataclasses.replace(data.draw(tied_examples(target.max_world_size), label="tied example"), calls=1)
    norm_type = data.draw(st.sampled_from(NORM_TYPES), label="norm_type")
    factor = data.draw(st.sampled_from(MAX_NORM_FACTORS), label="max_norm / norm")
    expected = dense(example)
    second = example.tied_copies()[1]
    counted = sorted(name for name in expected.grads if len(example.layers_per_stage) == 1 or name != f"stage{second[0]}.{second[1]}")
    want = float(ref_dp.total_norm([expected.grads[name] for name in counted], norm_type))
    example = dataclasses.replace(example, clip=(factor * want + 1e-3, norm_type))
    judge = Judge(str(example), target.reproduce(request.node.nodeid))
    judge_pipeline_clipping(judge, example, run_step(judge, ranks, example), counted, TIED_ONCE)
