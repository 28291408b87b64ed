"""--scope cs336 (harness/driver/plugin/options.py SCOPES): the data-parallel examples keep to the
CS336 handout's loop (one backward per step, zero_grad(set_to_none=True), every parameter used,
float32 models, ranks seeded apart hold rank 0's buffers), the default scope still draws the rest, and a failure's reproduce line keeps the
scope."""

from __future__ import annotations

import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

from parallelism_conformance.conformance.data_parallel_examples import examples
from parallelism_conformance.conformance.examples import training_examples
from parallelism_conformance.conformance.test_fully_sharded import handout_example
from parallelism_conformance.harness.driver.plugin.options import SCOPES
from parallelism_conformance.harness.driver.plugin.state import Target
from parallelism_conformance.harness.rank import models


@settings(max_examples=30, deadline=None)
@given(example=st.booleans().flatmap(lambda init: examples(4, "cs336", per_rank_init=init)))
def test_the_cs336_scope_draws_only_the_handouts_loop(example):
    assert example.micro_batches == 1 and example.set_to_none
    assert example.model["dtype"] == "float32"  # the handout trains float32 models only
    if example.model["kind"] == "tied_lm":  # TiedLM's default is to skip a parameter on alternate steps
        assert all(example.model[k] is False for k in ("skips", "skips_first", "skips_in_unit")), example.model
    rank_zero = dict(models.build(example.model_of(0), example.seed_of(0)).named_buffers())
    for rank in range(1, example.world_size):
        for name, buffer in models.build(example.model_of(rank), example.seed_of(rank)).named_buffers():
            assert torch.equal(buffer, rank_zero[name]), (rank, name)


def test_the_contract_scope_still_draws_accumulation_and_buffers_apart():
    find(examples(4, "contract", per_rank_init=False), lambda e: e.micro_batches > 1 and not e.set_to_none)
    find(examples(4, "contract", per_rank_init=False), lambda e: e.model["dtype"] == "float64")
    apart = find(
        examples(4, "contract", per_rank_init=True),
        lambda e: e.world_size > 1 and e.model.get("buffers", True) and e.model["kind"] == "tied_lm",
    )
    first = dict(models.build(apart.model_of(0), apart.seed_of(0)).named_buffers())
    second = dict(models.build(apart.model_of(1), apart.seed_of(1)).named_buffers())
    assert not torch.equal(first["offset"], second["offset"])


def test_a_failure_reproduces_with_its_scope_and_the_coverage_line_names_it():
    target = Target("parallelism_conformance.adapters.cs336", "auto", 4, "ci", scope="cs336")
    assert target.reproduce("conformance/test_data_parallel.py::t").endswith("--scope cs336")
    assert "--scope" not in Target("parallelism_conformance.impls", "auto", 4, "ci").reproduce("t")
    assert SCOPES["contract"] == "" and "CS336" in SCOPES["cs336"]


def test_the_cs336_scope_judges_the_zero_balance_in_parameter_tensors_or_elements():
    """Three weights and three biases dealt round-robin by index: every weight's state on rank 0
    (the figures of a CS336 submission: 54 and 12 AdamW state elements of 66): unbalanced in
    elements, as the contract counts them, balanced in parameters, as the handout words it; all
    state on one rank, or on every rank, fails both."""
    from types import SimpleNamespace

    import pytest

    from parallelism_conformance.conformance.test_sharded_optimizer import judge_state_sharding
    from parallelism_conformance.conformance.verdict import Judge

    example = SimpleNamespace(world_size=2, optimizer={"name": "adamw"})
    unsharded = {"w1": 18, "b1": 4, "w2": 18, "b2": 4, "w3": 18, "b3": 4}
    judge = Judge("example", "reproduce")
    with pytest.raises(AssertionError, match="balanced split"):
        judge_state_sharding(judge, example, {0: 54, 1: 12}, unsharded, "step 1")
    judge_state_sharding(judge, example, {0: 54, 1: 12}, unsharded, "step 1", "cs336", {0: 3, 1: 3}, 6)
    with pytest.raises(AssertionError, match="about 1/2 of the 6 parameters"):
        judge_state_sharding(judge, example, {0: 66, 1: 0}, unsharded, "step 1", "cs336", {0: 6, 1: 0}, 6)
    with pytest.raises(AssertionError, match="replicated"):
        judge_state_sharding(judge, example, {0: 66, 1: 66}, unsharded, "step 1", "cs336", {0: 6, 1: 6}, 6)
    # whole parameters by size (largest first to the least loaded rank), as the project's own CS336
    # fixture does: an MLP's 48-element weight on rank 0, its three small parameters on rank 1 is
    # unbalanced in tensors (1 and 3 of 4) and balanced in elements: the handout's words allow both
    sizes = {"fc1.weight": 96, "fc1.bias": 24, "fc2.weight": 24, "fc2.bias": 2}
    judge_state_sharding(judge, example, {0: 96, 1: 50}, sizes, "step 1", "cs336", {0: 1, 1: 3}, 4)


@settings(max_examples=30, deadline=None)
@given(example=training_examples(4))
def test_the_cs336_scope_trains_fsdp_on_the_handouts_models(example):
    """Float32, every parameter used, nothing tied, frozen or buffered, every weight's first
    dimension a multiple of the world size (the handout's test: even shapes at 2 ranks)."""
    handout = handout_example(example)
    assert handout.world_size == example.world_size and handout.model["dtype"] == "float32"
    net = models.build(handout.model, handout.seed)
    assert not list(net.named_buffers()) and all(p.requires_grad for p in net.parameters())
    names = [name for name, _ in net.named_parameters()]
    assert len(names) == len({id(p) for p in net.parameters()}) == len(list(net.parameters()))
    if handout.model["kind"] == "tied_lm":
        assert "head.weight" in names  # untied
    for name, p in net.named_parameters():
        assert p.shape[0] % handout.world_size == 0, (name, tuple(p.shape), handout.world_size)


def test_a_cs336_failure_reproduces_with_its_submission(monkeypatch):
    monkeypatch.setenv("CS336_SUBMISSION", "/submissions/a student")
    line = Target("parallelism_conformance.adapters.cs336", "auto", 2, "ci", scope="cs336").reproduce("t")
    assert line.startswith("CS336_SUBMISSION='/submissions/a student' parallelism-conformance t --impl parallelism_conformance.adapters.cs336")
    assert not Target("parallelism_conformance.impls", "auto", 2, "ci").reproduce("t").startswith("CS336")
    graded = Target("parallelism_conformance.adapters.cs336", "auto", 2, "grading", scope="cs336").reproduce("t")
    assert graded.startswith("CS336_SUBMISSION=your-repository parallelism-conformance t")  # no grading machine's path
    student = Target("/tmp/conformance-staged-x/hw2/student_impl.py", "auto", 2, "grading").reproduce("t")
    assert "--impl student_impl.py " in student and "/tmp" not in student
