"""``--parallelize`` (conformance/test_parallelize.py) on the known plans of parallelize_examples/ and
mutants/parallelize/, each on one mesh of the matrix (the test's id selects it): the good one passes
on dp_shard x tp, each bad one fails naming the step, the parameter and the mesh dimension it is
sharded on or the ranks differ along; the parity matrix printed and written
(harness/driver/parallelize_matrix.py); and, in this process, the declaration's errors, the meshes
collected and those skipped, and how the mutation runner grades the mutants."""

from __future__ import annotations

import pytest

from parallelism_conformance.conformance import test_parallelize as suite


def run_plan(suite_runner, spec: str, profile: str, mesh: str, *args: str):
    """The conformance test on one mesh (its id, ``dp_shard2-tp2``)."""
    return suite_runner.run(
        "conformance/test_parallelize.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "--parallelize",
        spec if spec.startswith("mutants/") else f"parallelize_examples/{spec}",
        "--max-world-size",
        "4",
        f"--hypothesis-profile={profile}",
        "-k",
        f"step_by_step and [{mesh}]",
        *args,
    )


def test_a_known_good_two_dimensional_plan_passes_and_its_matrix_is_written(suite_runner, tmp_path):
    """FSDP2 over torch's tensor-parallel styles on dp_shard x tp (parallelize_examples/good.py); the
    parity matrix printed and written, the meshes deselected 'not run'."""
    matrix = tmp_path / "matrix" / "fsdp_tp.md"
    result = run_plan(suite_runner, "good.py:fsdp_tp", "second_opinion", "dp_shard2-tp2", "--parallelize-matrix", str(matrix))
    assert result.returncode == 0 and "1 passed" in result.stdout and "deselected" in result.stdout, result.stdout[-4000:]
    assert "the parity matrix of parallelize_examples/good.py:fsdp_tp" in result.stdout, result.stdout[-4000:]
    assert "world 4  dp_replicate=1 x dp_shard=2 x tp=2" in result.stdout, result.stdout[-4000:]
    table = matrix.read_text()
    assert "| 4 | 1 | 2 | 2 | pass |" in table and "| 1 | 1 | 1 | 1 | not run |" in table, table
    assert "| 2 | 2 | 1 | 1 | skipped: needs dp_replicate |" in table and "1 pass, 0 fail, 12 skipped or not run." in table, table
    assert matrix.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"  # matplotlib is in this venv (the plots extra)


@pytest.mark.parametrize(
    "plan, mesh, named",
    [
        # the wrong value appears at w2's output: its weight's gradient is named, with its tp placement
        (
            "rowwise_output_left_partial",
            "tp2",
            [
                "gradient of 'layers.0.feed_forward.w2.weight' (sharded on tp as Shard(dim=1))",
                "first module whose forward output differs at step 1 on rank 0: 'layers.0.feed_forward.w2'",
            ],
        ),
        # every forward right, every gradient a replica's own: the first parameter, on a dp_replicate mesh
        (
            "replicas_not_averaged",
            "dp_replicate2",
            ["gradient of 'tok_embeddings.weight' (a plain tensor", "every module's forward output", "mesh dp_replicate=2"],
        ),
        (
            "gradient_divided_twice",
            "dp_shard2",
            ["gradient of 'tok_embeddings.weight' (sharded on dp_shard as Shard(dim=0))", "every rank holds the same value", "mesh dp_shard=2"],
        ),
        # a plain weight each tp rank holds: the dimension is the one its ranks' gradients differ along
        (
            "mutants/parallelize/sequence_parallel_norm_left_local.py:parallelize",
            "tp2",
            [
                "gradient of 'layers.0.ffn_norm.weight' (a plain tensor",
                "the ranks' values differ along tp",
                "FAIL at step 1: gradient of 'layers.0.ffn_norm.weight', rank 0, error",
            ],
        ),
    ],
)
def test_a_known_bad_plan_fails_naming_the_step_and_the_parameter(suite_runner, plan, mesh, named):
    result = run_plan(suite_runner, plan if plan.startswith("mutants/") else f"bad.py:{plan}", "brief", mesh)
    assert result.returncode == 1 and "1 failed" in result.stdout, result.stdout[-4000:]
    assert "AssertionError: step 1, rank " in result.stdout, result.stdout[-4000:]
    for text in named:
        assert text in result.stdout, (text, result.stdout[-4000:])


def test_a_plan_that_crashes_the_ranks_fails_its_test_with_their_traceback(suite_runner):
    """The down projection left out of the tensor-parallel plan: a shape error on every tp rank at
    tp = 2, one failed test naming the mesh, never a crashed run."""
    result = run_plan(suite_runner, "bad.py:down_projection_left_replicated", "brief", "tp2")
    assert result.returncode == 1 and "1 failed" in result.stdout, result.stdout[-4000:]
    assert "mat1 and mat2 shapes cannot be multiplied" in result.stdout and "example: mesh tp=2" in result.stdout, result.stdout[-4000:]
    assert "world 2  dp_replicate=1 x dp_shard=1 x tp=2       FAIL: RuntimeError: mat1 and mat2" in result.stdout, result.stdout[-4000:]


def test_the_matrix_has_a_test_per_declared_mesh_and_skips_the_others_saying_why(suite_runner):
    def run(*args):
        options = ("--parallelize", "parallelize_examples/good.py:fsdp", "--max-world-size", "2")
        return suite_runner.run("conformance/test_parallelize.py", "-q", "-p", "no:cacheprovider", *options, *args)

    listed = run("--collect-only").stdout
    ids = sorted(line.split("[")[1].rstrip("]") for line in listed.splitlines() if "one_process[" in line)
    assert ids == ["dp_replicate1-dp_shard1-tp2", "dp_replicate2-dp_shard1-tp1", "dp_shard1", "dp_shard2"], listed[-3000:]
    skipped = run("-rs", "-k", "tp2 or dp_replicate2").stdout
    assert skipped.strip().splitlines()[-1].startswith("4 skipped, 4 deselected"), skipped[-3000:]  # each mesh: values and traffic
    assert "dp_replicate=2 x dp_shard=1 x tp=1 needs dp_replicate, which parallelize_examples/good.py:fsdp does not declare" in skipped
    assert "dp_replicate=1 x dp_shard=1 x tp=2 needs tp, which" in skipped, skipped[-3000:]


def test_a_function_that_returns_no_model_fails_saying_so(suite_runner, tmp_path):
    """torchtitan's parallelize functions return the model; one that works in place and returns None
    is one failed test that says what it returned, not a crash further on."""
    plan = tmp_path / "in_place.py"
    plan.write_text("def parallelize(model, mesh):\n    model.zero_grad()\n\n\nparallelize.mesh_dims = ('tp',)\n")
    result = suite_runner.run(
        "conformance/test_parallelize.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "--parallelize",
        f"{plan}:parallelize",
        "--max-world-size",
        "1",
        "--hypothesis-profile=brief",
    )
    assert result.returncode == 1 and "1 failed" in result.stdout, result.stdout[-3000:]
    assert f"TypeError: {plan}:parallelize returned NoneType, not the model (an nn.Module)" in result.stdout, result.stdout[-3000:]


# bad input (issue 57, item 7): each one failed test on the mesh tp = 1 that says why, never a crashed run
BAD_INPUT = {
    "raises": "def parallelize(model, mesh):\n    raise ValueError(f'this plan takes no mesh of {mesh.size()} ranks')\n",
    "another_model": "import torch\n\n\ndef parallelize(model, mesh):\n    return torch.nn.Linear(2, 2).double()\n",
    "does_not_import": "import a_module_no_one_installed\n\n\ndef parallelize(model, mesh):\n    return model\n",
}


@pytest.mark.parametrize(
    "case, said",
    [
        (
            "raises",
            ["ValueError: this plan takes no mesh of 1 ranks", "(model, mesh) on the mesh [['tp', 1]], before any step", "FAIL: ValueError"],
        ),
        (
            "another_model",
            ["rank 0: the parameters of the model the plan returned: expected ['layers.0.attention.wk.weight'", "unexpected ['bias'"],
        ),
        ("does_not_import", ["could not load the function", "No module named 'a_module_no_one_installed'"]),
    ],
)
def test_bad_input_is_one_failed_test_saying_why(suite_runner, tmp_path, case, said):
    plan = tmp_path / f"{case}.py"
    plan.write_text(BAD_INPUT[case] + "\n\nparallelize.mesh_dims = ('tp',)\n")
    options = ("--parallelize", f"{plan}:parallelize", "--max-world-size", "1", "--hypothesis-profile=smoke")
    result = suite_runner.run("conformance/test_parallelize.py", "-q", "-p", "no:cacheprovider", *options)
    assert result.returncode == 1 and "1 failed" in result.stdout, result.stdout[-3000:]
    for text in said:
        assert text in result.stdout, (text, result.stdout[-3000:])


class Config:
    def __init__(self, spec):
        self.spec = spec

    def getoption(self, name):
        assert name == "--parallelize"
        return self.spec


def test_the_declaration_is_required_and_checked(tmp_path):
    plans = tmp_path / "plans.py"
    plans.write_text(
        "def undeclared(model, mesh):\n    return model\n"
        "def unknown(model, mesh):\n    return model\n"
        "unknown.mesh_dims = ('dp', 'tp')\n"
        "def good(model, mesh):\n    return model\n"
        "good.mesh_dims = ('tp', 'dp_shard')\n"
    )
    with pytest.raises(pytest.skip.Exception, match="no --parallelize"):
        suite.declared(Config(None))
    with pytest.raises(pytest.fail.Exception, match=r"declares no mesh dimensions: set undeclared.mesh_dims"):
        suite.declared(Config(f"{plans}:undeclared"))
    with pytest.raises(pytest.fail.Exception, match=r"mesh_dims must be a non-empty tuple among .* got \('dp', 'tp'\)"):
        suite.declared(Config(f"{plans}:unknown"))
    with pytest.raises(pytest.fail.Exception, match=r"could not load the function: AttributeError.*has no 'absent'"):
        suite.declared(Config(f"{plans}:absent"))
    assert suite.declared(Config(f"{plans}:good"))[2] == ("dp_shard", "tp")  # the mesh's order, not the declaration's


def test_the_meshes_drawn_are_every_factorisation_over_the_declared_dimensions():
    drawn, skipped = suite.mesh_choices(("dp_shard", "tp"), 4)
    # ordered factorisations of 1, 2, 3, 4 into two factors: 1 + 2 + 2 + 3; into three: 1 + 3 + 3 + 6
    assert len(drawn) == 8 and len(drawn) + len(skipped) == 13
    assert (("dp_shard", 2), ("tp", 2)) in drawn and (("dp_shard", 1), ("tp", 1)) in drawn
    assert all(dict(mesh)["dp_replicate"] > 1 for mesh in skipped)


def test_the_mutation_runner_grades_each_parallelize_mutant_through_the_option():
    """mutants/parallelize/<file>.py is a team's function: run with --parallelize <file>:parallelize
    beside the bundled implementations (harness/driver/mutation_catalog.py), never as the --impl."""
    from parallelism_conformance.harness.driver.mutation_catalog import mutants

    ours = [m for m in mutants() if m.path.parent.name == "parallelize"]
    assert len(ours) >= 7, [m.path.name for m in ours]
    for mutant in ours:
        assert mutant.test_file == "conformance/test_parallelize.py" and mutant.impl_and_env() == ("parallelism_conformance.impls", None)
        spec = f"mutants/parallelize/{mutant.path.name}:parallelize"
        assert mutant.graded_args() == ["--parallelize", spec, "--capability", "parallelize", "-k", "step_by_step"]
        assert suite.declared(Config(spec))[1].__name__ in ("parallelize", mutant.path.stem)


def test_the_placements_claim_is_the_largest_shard_ceil_per_dimension():
    """reference/parallelize.py's claimed_bytes: Shard divides its tensor dimension (ceil, torch's
    uneven chunks), nested shards of one dimension multiply, Replicate and Partial divide nothing."""
    from parallelism_conformance.reference.parallelize import claimed_bytes

    sizes = {"dp_shard": 2, "tp": 3}
    assert claimed_bytes([8, 6], 8, {}, {}) == 8 * 6 * 8  # a plain tensor: whole
    assert claimed_bytes([8, 6], 8, {"dp_shard": "Shard(dim=0)", "tp": "Replicate()"}, sizes) == 4 * 6 * 8
    assert claimed_bytes([7, 6], 8, {"dp_shard": "Shard(dim=0)", "tp": "Shard(dim=1)"}, sizes) == 4 * 2 * 8  # ceil(7 / 2)
    assert claimed_bytes([7, 6], 4, {"dp_shard": "_StridedShard(dim=0, sf=3)", "tp": "Shard(dim=0)"}, sizes) == 2 * 6 * 4  # ceil(7 / 6)
    assert claimed_bytes([5], 8, {"dp_shard": "Partial(sum)", "tp": "Shard(dim=-1)"}, sizes) == 2 * 8


def _record(shape, local_numel, placements=None, sizes=None):
    return {"shape": shape, "itemsize": 8, "local": 8 * local_numel, "placements": placements or {}, "sizes": sizes or {}}


def test_memory_above_the_claim_costs_more_and_fails_only_when_bounds_are_required():
    """conformance/parallelize_memory.py on plain records: an FSDP-sharded parameter, its gradient and
    AdamW's state (the step scalar claimed whole) hold exactly their claim; a gradient left whole where
    its parameter is sharded, and a buffer the dense model has not, are above it, named with the ratio."""
    from parallelism_conformance.conformance.parallelize_memory import findings, judge_memory
    from parallelism_conformance.conformance.verdict import Judge

    shard = {"dp_shard": "Shard(dim=0)"}
    weight = _record([4, 2], 4, shard, {"dp_shard": 2})
    state = [_record([4, 2], 4, shard, {"dp_shard": 2}), _record([4, 2], 4, shard, {"dp_shard": 2}), _record([], 1)]
    memory = {"params": {"w": weight}, "grads": {"w": dict(weight)}, "optimizer": {"w": state}, "buffers": {"freqs": _record([3], 3)}}
    outputs = {0: {"memory": memory}, 1: {"memory": memory}}
    assert findings(outputs, {"freqs"}) == (1.0, None)
    costly = {
        **memory,
        "grads": {"w": _record([4, 2], 8, {"dp_shard": "Replicate()"}, {"dp_shard": 2})},
        "buffers": {"copy": _record([4, 2], 8)},
    }
    ratio, finding = findings({0: {"memory": memory}, 1: {"memory": costly}}, set())
    held, claim = 8 * (4 + 8 + 4 + 4 + 1 + 8), 8 * (4 + 4 + 4 + 4 + 1)  # rank 0's 'freqs', claimed 0 here, is 20 / 17: less
    assert ratio == held / claim and finding.startswith(f"memory: rank 1 holds {held} B") and f"{ratio:.3g}x its placements' claim" in finding
    assert "gradient 'w' 64 B against 32 B (placed Replicate() on dp_shard; its parameter Shard(dim=0) on dp_shard)" in finding
    assert "buffer 'copy' 64 B against 0 B" in finding
    costs, judge = [], Judge("the example", "rerun")
    judge_memory(judge, {0: {"memory": costly}}, set(), False, costs)
    judge_memory(judge, {0: {"memory": costly}}, set(), False, costs)
    assert len(costs) == 1 and costs[0].startswith("costs more (the example): memory: rank 0")  # said once, beside a pass
    with pytest.raises(AssertionError, match=r"costs more than the placements claim \(--require-bounds\): memory: rank 0"):
        judge_memory(judge, {0: {"memory": costly}}, set(), True, [])


def test_a_plan_keeping_a_full_copy_costs_more_with_its_ratio_and_fails_under_require_bounds(suite_runner, tmp_path):
    """parallelize_examples/costly.py: FSDP2 on dp_shard with a whole copy of the head's weight kept as
    a buffer. Right values: it passes, its matrix cell and its report read costs more with the ratio;
    under --require-bounds yes it fails, naming the buffer."""
    spec = "costly.py:fsdp_keeping_a_full_copy"
    report = tmp_path / "report.xml"
    result = run_plan(suite_runner, spec, "smoke", "dp_shard2", f"--junitxml={report}")
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-4000:]
    assert "costs more: memory 1.1x, rank 0 (buffer 'output_weight_copy')" in result.stdout, result.stdout[-4000:]
    text = report.read_text()
    assert 'name="verdict" value="costs more"' in text and 'name="memory_ratio" value="1.09524"' in text, text[-3000:]
    strict = run_plan(suite_runner, spec, "smoke", "dp_shard2", "--require-bounds", "yes")
    assert strict.returncode == 1 and "1 failed" in strict.stdout, strict.stdout[-4000:]
    assert "costs more than the placements claim (--require-bounds): memory: rank 0 holds 368 B" in strict.stdout, strict.stdout[-4000:]
    assert "FAIL: costs more: memory 1.1x, rank 0 (buffer 'output_weight_copy')" in strict.stdout, strict.stdout[-4000:]


def test_the_traffic_is_keyed_by_the_mesh_dimensions_its_group_spans_and_bounded_by_the_placements():
    """conformance/parallelize_traffic.py in this process: groups keyed by the coordinates that differ
    (row-major over dp_replicate, dp_shard, tp), integers not charged, and the placements' bound:
    an FSDP parameter's two all-gathers and one reduce-scatter along dp_shard, a replicated one's
    all-reduce along every data-parallel key."""
    from parallelism_conformance.conformance import parallelize_traffic as traffic

    sizes = {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    assert traffic.key_of(0, [0, 2], sizes) == "dp_shard" and traffic.key_of(5, [1, 5], sizes) == "dp_replicate"
    assert traffic.key_of(0, [0, 2, 4, 6], sizes) == "dp_replicate+dp_shard" and traffic.key_of(3, [2, 3], sizes) == "tp"
    record = lambda op, group, numel, dtype="float64", phase="backward": {
        **{"op": op, "group": group, "peer": None, "rank": 0, "dtype": dtype, "itemsize": 8, "numel": numel, "bytes": 8 * numel},
        **{"out_numel": 0, "out_bytes": 0, "root": None, "reduce_op": "SUM", "splits": None, "tag": None, "phase": phase},
    }
    carried = traffic.traffic(
        {0: [record("allreduce", [0, 4], 6), record("allreduce", [0, 4], 6, "int32"), record("allreduce", [0, 4], 6, phase="harness")]},
        sizes,
    )
    assert carried == {0: {"dp_replicate": 48}}  # 2 (n-1)/n of 6 float64; the integers and the harness's gathers not charged
    params = {
        "fsdp": {"shape": [8, 4], "itemsize": 8, "placements": {"dp_shard": "Shard(dim=0)"}, "sizes": {"dp_shard": 2}},
        "plain": {"shape": [3], "itemsize": 8, "placements": {}, "sizes": {}},
    }
    bounds = traffic.implied(params, {"dp_replicate": 1, "dp_shard": 2, "tp": 1})
    # fsdp: 2 x all-gather of 32 elements (16 sent each) + a reduce-scatter of 32 (16 sent): 48 x 8 B; plain: all-reduce of 3 over 2 (4 sent)
    assert bounds == {"dp_shard": 48 * 8 + 4 * 8}, bounds


def test_a_plan_gathering_whole_weights_to_log_them_costs_more_traffic_and_torchs_ddp_does_not(suite_runner, tmp_path):
    """parallelize_examples/costly.py: FSDP2 whose forward pre-hook takes every weight's norm on the
    whole weight (an all-gather a parameter a step beyond FSDP's): right values, its traffic along
    dp_shard 1.22x what the placements imply, a failure only under --require-bounds yes; torch's DDP
    (good.py's ddp) exactly at its bound, 1.0x (its bucket order, integers, not charged)."""

    def traffic_of(spec: str, mesh: str, *args: str):
        report = tmp_path / f"{mesh}.xml"
        result = suite_runner.run(
            *("conformance/test_parallelize.py", "-q", "-p", "no:cacheprovider", "--parallelize", f"parallelize_examples/{spec}"),
            *("--max-world-size", "4", "--hypothesis-profile=smoke", "-k", f"traffic and [{mesh}]", f"--junitxml={report}", *args),
        )
        return result, report.read_text() if report.exists() else ""

    result, text = traffic_of("costly.py:fsdp_logging_full_weight_norms", "dp_shard2")
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-4000:]
    assert 'name="traffic_ratio" value="1.21769"' in text and "dp_shard: 2864 B per step" in text, text[-3000:]
    assert "traffic: dp_shard: 2864 B (1.22x the placements')" in result.stdout, result.stdout[-4000:]  # its matrix line
    strict, _ = traffic_of("costly.py:fsdp_logging_full_weight_norms", "dp_shard2", "--require-bounds", "yes")
    assert strict.returncode == 1 and "traffic: rank 0 sent 5728 B along dp_shard in 2 step(s), 1.22x" in strict.stdout, strict.stdout[-4000:]
    ddp, text = traffic_of("good.py:ddp", "dp_replicate2")
    assert ddp.returncode == 0 and 'name="traffic_ratio" value="1"' in text and "costs more" not in ddp.stdout, ddp.stdout[-4000:]


def test_the_matrix_names_the_smallest_failing_mesh():
    """Hypothesis shrinks within a mesh's test; across meshes, the matrix names the failing mesh of
    the fewest ranks (harness/driver/parallelize_matrix.py), in its summary and its markdown."""
    from parallelism_conformance.harness.driver.parallelize_matrix import Matrix

    meshes = {
        "dp_shard1": ((("dp_shard", 1),), ""),
        "dp_shard4": ((("dp_shard", 4),), ""),
        "dp_shard2": ((("dp_shard", 2),), ""),
    }
    matrix = Matrix("plan.py:f", meshes, verdicts={"dp_shard1": "pass", "dp_shard4": "FAIL at step 2: x", "dp_shard2": "FAIL at step 1: y"})
    assert matrix.smallest_failing() == "world 2, dp_shard=2: FAIL at step 1: y"
    assert "The smallest failing mesh: world 2, dp_shard=2: FAIL at step 1: y." in matrix.markdown()
    assert Matrix("plan.py:f", meshes, verdicts={"dp_shard1": "pass"}).smallest_failing() is None
