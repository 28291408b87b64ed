"""``--parallelize`` in torchtitan's form on torchtitan's own Llama (issue 57, items 1-2):
parallelize_examples/torchtitan_llama.py's wrapper of ``parallelize_llama`` graded by
conformance/test_parallelize.py in torchtitan's venv, on one small mesh with the smoke profile (one
example), its parity matrix printed; and, in this process (no torchtitan needed), what the suite
draws for that model, how it checks a function's form and model, and torchtitan's form on the
suite's decoder with the stand-in ParallelDims (harness/rank/parallel_dims_stand_in.py). The venv is made by
``scripts/libraries --prepare torchtitan`` (the test command makes it); where it was not, the venv
test skips saying so, except under CONFORMANCE_REQUIRE_LIBRARIES (.ci/run), where it fails, as
tests/test_libraries.py does."""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism_conformance.conformance import test_parallelize as suite
from parallelism_conformance.conformance.parallelize_draws import examples
from parallelism_conformance.harness.driver.libraries.table import LIBRARIES
from parallelism_conformance.harness.driver.libraries.venvs import ROOT, venv_of

REQUIRED = bool(os.environ.get("CONFORMANCE_REQUIRE_LIBRARIES"))
SPEC = "parallelize_examples/torchtitan_llama.py:parallelize_llama"


def torchtitan_venv():
    library = LIBRARIES["torchtitan"]
    venv = venv_of(library, library.pinned)
    if not list(venv.path.glob(".libraries-installed-*")):
        why = f"torchtitan=={library.pinned} has no venv here: scripts/libraries --prepare torchtitan makes it"
        if REQUIRED:
            pytest.fail(why + " (CONFORMANCE_REQUIRE_LIBRARIES is set: the test command prepares every one)")
        pytest.skip(why)
    return venv


def test_parallelize_llama_on_its_llama_trains_as_one_process_on_a_tp_mesh():
    """torchtitan's parallelize_llama (tensor and sequence parallel by its model's parallelize, then
    apply_fsdp_to_decoder) on dp_shard 1 x tp 2, one drawn example: every step's loss, gradients
    and parameters equal the dense Llama's; the matrix printed at the end."""
    venv = torchtitan_venv()
    done = subprocess.run(
        [
            str(venv.python),
            "-m",
            "pytest",
            "conformance/test_parallelize.py",
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "--parallelize",
            SPEC,
            "--max-world-size",
            "2",
            "--hypothesis-profile=smoke",
            "-k",
            "step_by_step and [dp_replicate1-dp_shard1-tp2]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=venv.environment(dict(os.environ)),
        timeout=300,
    )
    out = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0 and "1 passed" in done.stdout, out
    assert f"the parity matrix of {SPEC}" in done.stdout and "dp_replicate=1 x dp_shard=1 x tp=2" in done.stdout, out


@settings(max_examples=20, deadline=None, database=None)
@given(data=st.data(), tp=st.sampled_from([1, 2, 4]))
def test_torchtitans_llama_is_drawn_with_its_sizes_tied_and_in_float32(data, tp):
    """dim = heads x head_dim with head_dim 2 (ComplexRoPE pairs it), heads and ffn multiples of tp,
    the sequence and vocabulary too where the function declares it, float32."""
    mesh = (("dp_shard", 1), ("tp", tp))
    example = data.draw(examples(mesh, ("seq", "vocab"), "torchtitan_llama3"))
    model = example.model
    assert example.model_kind == "torchtitan_llama3" and model["dtype"] == "float32" and model["head_dim"] == 2
    assert model["kv_heads"] % tp == 0 and model["heads"] % model["kv_heads"] == 0 and model["ffn"] % tp == 0
    assert model["vocab"] % tp == 0 and example.seq % tp == 0 and "dim" not in model


def test_a_function_declares_its_form_and_model_or_fails_naming_them():
    """Unknown ones fail naming them; torchtitan's, where torchtitan does not import, fail once in the
    driver saying where to run (not a ModuleNotFoundError from every rank)."""

    def plan(model, parallel_dims, job_config):
        return model

    assert suite.form_and_model("x:plan", plan) == ("mesh", "decoder")
    plan.form, plan.model = "torchtitan", "torchtitan_llama3"
    if importlib.util.find_spec("torchtitan") is None:  # this venv (the project's): said once, in the driver
        with pytest.raises(pytest.fail.Exception, match="its model 'torchtitan_llama3' needs torchtitan"):
            suite.form_and_model("x:plan", plan)
    else:
        assert suite.form_and_model("x:plan", plan) == ("torchtitan", "torchtitan_llama3")
    plan.form = "job_config"
    with pytest.raises(pytest.fail.Exception, match="form must be one of \\('mesh', 'torchtitan'\\), got 'job_config'"):
        suite.form_and_model("x:plan", plan)
    plan.form, plan.model = "torchtitan", "llama"
    with pytest.raises(pytest.fail.Exception, match="model must be one of"):
        suite.form_and_model("x:plan", plan)


def test_torchtitans_form_where_torchtitan_does_not_import_is_one_failed_test_saying_where_to_run(suite_runner):
    """The project's venv has no torchtitan: the wrapper's module imports (torchtitan only when it
    runs), and the run is one failed test naming what needs torchtitan, before any rank starts."""
    if importlib.util.find_spec("torchtitan") is not None:
        pytest.skip("torchtitan imports here: the venv test above runs it")
    result = suite_runner.run("conformance/test_parallelize.py", "-q", "-p", "no:cacheprovider", "--parallelize", SPEC, "--max-world-size", "2")
    assert result.returncode == 1 and "1 failed" in result.stdout, result.stdout[-3000:]
    assert "its model 'torchtitan_llama3' needs torchtitan" in result.stdout, result.stdout[-3000:]


AVERAGED = """from parallelism_conformance.parallelize_examples.good import TP_PLAN, fully_shard, parallelize_module


def parallelize(model, parallel_dims, job_config):
    for block in model.layers:
        parallelize_module(block, parallel_dims.get_mesh("tp"), TP_PLAN)
    for module in [*model.layers, model]:
        fully_shard(module, mesh=parallel_dims.get_mesh("fsdp"))  # averaged: FSDP2's default
    return model


parallelize.form = "torchtitan"
parallelize.mesh_dims = ("dp_shard", "tp")
"""


def test_torchtitans_form_on_the_decoder_runs_with_the_stand_in_and_its_loss_wants_summed_gradients(suite_runner, tmp_path):
    """good.py's torchtitan_form_fsdp_tp (parallel_dims.get_mesh, gradients summed) passes on dp_shard 2
    x tp 2 with torchtitan's ParallelDims or the stand-in (harness/rank/parallel_dims_stand_in.py);
    the same plan leaving FSDP2's average in place fails: this form's loss is torchtitan's, over the
    global token count, and the averaged gradient is 1 / dp of it on every rank."""

    def run(spec):
        options = ("--parallelize", spec, "--max-world-size", "4", "--hypothesis-profile=smoke", "-k", "step_by_step and [dp_shard2-tp2]")
        return suite_runner.run("conformance/test_parallelize.py", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *options)

    good = run("parallelize_examples/good.py:torchtitan_form_fsdp_tp")
    assert good.returncode == 0 and "1 passed" in good.stdout, good.stdout[-3000:]
    (tmp_path / "averaged.py").write_text(AVERAGED)
    bad = run(f"{tmp_path / 'averaged.py'}:parallelize")
    assert bad.returncode == 1 and "1 failed" in bad.stdout, bad.stdout[-3000:]
    assert "step 1, rank 0: gradient of" in bad.stdout and "every rank holds the same value" in bad.stdout, bad.stdout[-3000:]
