"""Conformance of checkpoints that reshard (capability ``checkpoint_reshard``):
``save_checkpoint(path, model, optimizer)`` under one data-parallel layout and world size,
``load_checkpoint(path, model, optimizer)`` under another (CONTRACT.md, "Checkpoints that reshard"),
against reference/data_parallel.py's one process that never stopped.

Reported bugs this is for: ROCm/Megatron-LM#63 (an FSDP checkpoint loaded on another GPU count put a
weight's chunks in the wrong order: loss to about 10), databricks/flashoptim#3 (after a save and load
of the optimizer state the first step sent the loss from 2.4 to 1785), torchtitan#1136 (a resume
with a vocabulary that does not divide by the world size left the uninterrupted run's loss). None
shows before the resumed run's first step, and a same-size resume (what most tests try) hides them.

Each example draws a model and optimizer (conformance/examples.py), a layout A (fully sharded or
ZeRO-1) on n = 1-4 ranks and a layout B on n' = 1-4 ranks, k = 1-3 steps before the save and k' = 1-2
after, on a global batch that splits evenly over both. World A trains and saves
(harness/rank/programs/checkpointing.py: save); the driver carries the files it wrote to world B,
which loads them three times on fresh objects (resume): into another architecture (a hidden layer
one wider, or a module replaced by one with other parameters), without one of the files, and whole. In the
driver:

* A's state after k steps follows one process (the bounds of reference/data_parallel.py);
* another architecture is refused on every rank, and a checkpoint without one of its files is
  refused on every rank or loaded exactly;
* after the load every parameter and buffer is bitwise what A saved, on every rank;
* each step after it follows the same one process at step k + s (its optimizer state travelled:
  momentum, AdamW's moments and step count, and none for a parameter saved without state).
"""
from __future__ import annotations

import math
import secrets

import pytest
from hypothesis import given
from hypothesis import strategies as st

import reference.data_parallel as ref
from conformance.examples import Layout, model_specs, optimizer_specs
from conformance.verdict import Judge, check_names
from harness.rank import models

LAYOUTS = ("fully_sharded", "sharded_optimizer")


@st.composite
def reshard_examples(draw, max_world_size: int) -> dict:
    top = max(1, min(4, max_world_size))
    example = {"layout_a": draw(st.sampled_from(LAYOUTS), label="layout A"),
               "n_a": draw(st.integers(1, top), label="world A"),
               "layout_b": draw(st.sampled_from(LAYOUTS), label="layout B"),
               "n_b": draw(st.integers(1, top), label="world B"),
               "model": draw(model_specs, label="model"), "optimizer": draw(optimizer_specs, label="optimizer"),
               "steps_a": draw(st.integers(1, 3), label="steps before the save"),
               "steps_b": draw(st.integers(1, 2), label="steps after the load"),
               "seed": draw(st.integers(0, 2**16), label="seed"), "data_seed": draw(st.integers(0, 2**16))}
    example["batch"] = math.lcm(example["n_a"], example["n_b"]) * draw(st.integers(1, 2), label="samples per lcm")
    model = example["model"]
    if model["kind"] == "tied_lm" and draw(st.booleans(), label="other architecture: aux replaced"):
        # aux.weight against aux.scale and aux.linear.weight: names absent on one side, extra on the other
        example["other_model"] = dict(model, skips_in_unit=not model["skips_in_unit"])
        example["other"] = "the module aux replaced by one with other parameters"
    else:
        example["other_model"], example["other"] = dict(model, hidden=model["hidden"] + 1), "hidden + 1"
    return example


def describe(example: dict) -> str:
    return (f"{example['layout_a']} on {example['n_a']} -> {example['layout_b']} on {example['n_b']}, "
            f"model=({example['model']}), optimizer=({example['optimizer']}), {example['steps_a']} steps then "
            f"{example['steps_b']}, global batch {example['batch']}, seed={example['seed']}, "
            f"data_seed={example['data_seed']}")


@pytest.mark.capability("checkpoint_reshard")
@given(data=st.data())
def test_a_checkpoint_resumes_under_another_layout_and_world_size(data, ranks, target, request):
    example = data.draw(reshard_examples(target.max_world_size), label="example")
    judge = Judge(describe(example), target.reproduce(request.node.nodeid))
    n_a, n_b, k = example["n_a"], example["n_b"], example["steps_a"]
    batch = models.make_batch(example["model"], example["batch"], example["data_seed"])
    common = {"model": example["model"], "optimizer": example["optimizer"]}
    token = secrets.token_hex(8)
    saved = judge.run(ranks, Layout(n_a), "checkpointing:save", [
        {**common, "layout": example["layout_a"], "seed": example["seed"], "steps": k, "batch": part,
         "token": token} for part in ref.split_batch(batch, n_a)])
    expected = ref.train(models.build(example["model"], example["seed"]), example["optimizer"], batch,
                         k + example["steps_b"])
    exact = exact_names(example["model"])
    for r in range(n_a):
        check_state(judge, saved[r]["state"], expected, k, exact, f"world A's rank {r} after {k} steps, when it saved")
    files = saved[0].get("files")
    if not isinstance(files, dict) or not files:
        judge.fail(f"save_checkpoint wrote no file under the directory it was given ({files!r})")
    dropped = data.draw(st.sampled_from(sorted(files)), label="the file left out")
    resumed = judge.run(ranks, Layout(n_b), "checkpointing:resume", [
        {**common, "layout": example["layout_b"], "seed": example["seed"] + 1, "steps": example["steps_b"],
         "batch": part, "files": files, "token": secrets.token_hex(8), "other_model": example["other_model"],
         "dropped": dropped} for part in ref.split_batch(batch, n_b)])
    want = saved[0]["state"]
    check_refused(judge, [resumed[r]["other_architecture"] for r in range(n_b)],
                  f"loading into another architecture ({example['other']})")
    check_missing_file(judge, [resumed[r]["missing_file"] for r in range(n_b)], want, dropped)
    for r in range(n_b):
        got = resumed[r]
        check_names(judge, got["loaded"], want, f"world B's rank {r} after load_checkpoint: parameters and buffers")
        for name, value in want.items():
            judge.tensor(got["loaded"][name], value, what=f"world B's rank {r} '{name}' after load_checkpoint "
                         "(bitwise what world A saved)")
        for s, state in enumerate(got["states"]):
            check_state(judge, state, expected, k + s + 1, exact,
                        f"world B's rank {r} after its step {s + 1} (step {k + s + 1} of one process that never stopped)")


def exact_names(model: dict) -> set[str]:
    """Frozen parameters and buffers: training leaves them bitwise as they were."""
    net = models.build(model, 0)
    return {name for name, p in net.named_parameters() if not p.requires_grad} | {n for n, _ in net.named_buffers()}


def check_state(judge: Judge, got: dict, expected: ref.Trajectory, step: int, exact: set[str], who: str) -> None:
    want = expected.states[step - 1]
    check_names(judge, got, want, f"{who}: full parameters and buffers")
    for name, value in want.items():
        judge.tensor(got[name], value, atol=None if name in exact else ref.param_atol(expected, step, name),
                     what=f"{who}: '{name}' (one process on the global batch)")


def check_refused(judge: Judge, outcomes: list[dict], what: str) -> None:
    loaded = [r for r, outcome in enumerate(outcomes) if "raised" not in outcome]
    if loaded:
        raised = {r: o["raised"] for r, o in enumerate(outcomes) if "raised" in o}
        judge.fail(f"{what}: rank(s) {loaded} loaded it without an error (a checkpoint of another architecture must "
                   f"be refused on every rank)" + (f"; the others raised {raised}" if raised else ""))


def check_missing_file(judge: Judge, outcomes: list[dict], want: dict, dropped: str) -> None:
    """All ranks raised, or all loaded exactly what was saved."""
    raised = [r for r, outcome in enumerate(outcomes) if "raised" in outcome]
    if raised and len(raised) != len(outcomes):
        judge.fail(f"without the file {dropped!r}, rank(s) {raised} raised and the others loaded: a refusal must "
                   "come from every rank")
    if raised:
        return
    for r, outcome in enumerate(outcomes):
        got = outcome["loaded"]
        check_names(judge, got, want, f"rank {r} after loading the checkpoint without {dropped!r}")
        for name, value in want.items():
            judge.tensor(got[name], value, what=f"rank {r} '{name}' loaded from the checkpoint without the file "
                         f"{dropped!r} (it must be refused, or load exactly what was saved)")
