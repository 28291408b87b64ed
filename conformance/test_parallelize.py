"""Conformance of a team's parallelize function (capability ``parallelize``, ``--parallelize
MODULE:FUNCTION``; CONTRACT.md, "A parallelize function"): ``function(model, mesh) -> model`` applied
to the suite's decoder LM (harness/rank/decoder_lm.py, torchtitan's Llama module paths) on a named
DeviceMesh, trained K steps on the ranks (harness/rank/programs/parallelize.py), judged step by step
in the driver against the dense twin built from the same seed on the global batch
(reference/parallelize.py: why each step is judged from the state the ranks reached, and the bound).

torchtitan's form, ``function(model, parallel_dims, job_config)`` (``function.form =
"torchtitan"``), gets torchtitan's ParallelDims and config sections instead of the mesh
(harness/rank/torchtitan_form.py), and a function may declare torchtitan's own Llama as its model
(``function.model = "torchtitan_llama3"``; harness/rank/parallelize_models.py), which needs
torchtitan here, in its venv (the form alone does not: harness/rank/parallel_dims_stand_in.py).

The function declares the mesh dimensions it handles (``function.mesh_dims``, among dp_replicate,
dp_shard, tp). The test is parametrized by mesh, the parity matrix: one test per factorisation of
worlds 1 to --max-world-size over the declared dimensions (a declared dimension of size 1 too; id
``dp_shard2-tp2``, so ``-k "[dp_shard2-tp2]"`` runs one), and every other factorisation skipped with
the dimension it needs. Hypothesis draws the rest per mesh: the model (heads and key/value heads
multiples of tp, ffn a multiple of tp, dim, vocabulary, 1-2 layers; a row-parallel layer's input at
least 2 wide, see ``examples``), rows per replica, sequence length, 1-3 steps, SGD (momentum,
weight decay) or AdamW (weight decay), and the loss normalisation: each rank's mean over its tokens (no padding),
or the global batch's valid-token mean (about a quarter of the targets ignored: each rank's summed
loss times dp / N). In torchtitan's form the loss is always torchtitan's train_step's, each rank's
summed loss over N (with or without padding), and the plan sums the gradients over dp, as
torchtitan's FSDP does (divide factor 1). A function that shards the sequence or the vocabulary
over tp (torchtitan's sequence parallel, a row-parallel embedding) declares ``function.divisible_by_tp = ("seq",
"vocab")`` and gets those in multiples of tp: torch 2.13's DTensor fails on uneven shards there
(an empty sequence shard: a view of 0 elements and a peer hung; vocabulary rows: the embedding's
gradient accumulation "in-place operations that require placement changes"), and torchtitan's
models have such sizes. Data-parallel ranks (dp_replicate x dp_shard) take their rows of the global
batch; tensor-parallel peers the same rows.

In the driver, per step s and rank: every gradient, then the loss, against the dense model at the
parameters rank 0 held before step s; every parameter after the step against the optimizer's step
from the rank's own parameters and gradient, and against rank 0's. A failure names the step, the
rank, the parameter's module path and the mesh dimensions it is sharded on (its placements), the
dimensions along which the ranks' gathered values differ (a reduction over them missing) or that
every rank holds the same wrong value, and the first module whose forward output at step 1 already differs from the dense model's rows of that
rank (modules whose output is a shard of another shape are passed over); the gradients of that
module's parameters are judged first, so the parameter named is where the wrong value appears
(with none, in the model's order: a data-parallel bug leaves every forward right). Before the first step
every rank's gathered parameters must be the dense model's, exactly: a plan moves data, it does not
change it. Once the values pass, each rank's parameter, gradient, optimizer-state and buffer
bytes after step 1 against its placements' claim (conformance/parallelize_memory.py): above it is
"costs more" with the ratio, a failure only under --require-bounds yes. The parity matrix of the run (every mesh against its verdict) is printed at the end and,
with --parallelize-matrix, written: harness/driver/parallelize_matrix.py, registered here.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import parallelism_conformance.reference.parallelize as ref
from parallelism_conformance.conformance import parallelize_traffic as traffic
from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.parallelize_draws import (
    DIMS,
    DIVISIBLE,
    Example,
    describe_mesh,
    examples,
    fixed_example,
    mesh_choices,
    mesh_id,
)
from parallelism_conformance.conformance.parallelize_memory import judge_memory
from parallelism_conformance.conformance.verdict import Judge, check_names, mismatch
from parallelism_conformance.harness.driver.failures import TASK_FAILURES
from parallelism_conformance.harness.driver.parallelize_matrix import Matrix
from parallelism_conformance.harness.driver.plugin.state import STATE, backend_plan
from parallelism_conformance.harness.rank import decoder_lm, parallelize_models
from parallelism_conformance.harness.rank.programs.parallelize import load_function
from parallelism_conformance.harness.rank.torchtitan_form import FORM, FORMS

PROGRAM = "parallelize:parallelize_steps"
MATRIX = "parallelize-matrix"  # the plugin's name (harness/driver/parallelize_matrix.py)

pytestmark = pytest.mark.capability("parallelize")


def declared(config) -> tuple[str, object, tuple[str, ...]]:
    """(the --parallelize spec, the function, its declared mesh dims, in DIMS order); skips when no
    function was given, fails naming the cause when it cannot be loaded or declares none."""
    spec = config.getoption("--parallelize")
    if spec is None:
        pytest.skip("no --parallelize MODULE:FUNCTION given: there is no parallelize function to grade")
    try:
        function = load_function(spec, os.getcwd())
    except Exception as error:  # noqa: BLE001 - whatever the module raises is the reason it failed
        pytest.fail(f"--parallelize {spec}: could not load the function: {error!r}", pytrace=False)
    dims = getattr(function, "mesh_dims", None)
    if dims is None:
        pytest.fail(
            f"--parallelize {spec}: the function declares no mesh dimensions: set {function.__name__}.mesh_dims to those it "
            f"handles, a tuple among {DIMS} (CONTRACT.md, 'A parallelize function')",
            pytrace=False,
        )
    unknown = [d for d in ([dims] if isinstance(dims, str) else dims) if d not in DIMS]
    if isinstance(dims, str) or unknown or not dims:
        pytest.fail(f"--parallelize {spec}: mesh_dims must be a non-empty tuple among {DIMS}, got {dims!r}", pytrace=False)
    form_and_model(spec, function)  # its form and model checked here too: a bad one is one test, not one a mesh
    return spec, function, tuple(d for d in DIMS if d in dims)


def divisible_by_tp(spec: str, function) -> tuple[str, ...]:
    """The function's ``divisible_by_tp`` (default none), checked against DIVISIBLE."""
    sizes = getattr(function, "divisible_by_tp", ())
    if isinstance(sizes, str) or any(size not in DIVISIBLE for size in sizes):
        pytest.fail(f"--parallelize {spec}: divisible_by_tp must be a tuple among {DIVISIBLE}, got {sizes!r}", pytrace=False)
    return tuple(sizes)


def form_and_model(spec: str, function) -> tuple[str, str]:
    """The function's ``form`` (default "mesh": ``function(model, mesh)``; "torchtitan":
    ``function(model, parallel_dims, job_config)``) and ``model`` (default "decoder"), checked."""
    form, model = getattr(function, "form", "mesh"), getattr(function, "model", "decoder")
    if form not in FORMS:
        pytest.fail(f"--parallelize {spec}: form must be one of {FORMS}, got {form!r}", pytrace=False)
    if model not in parallelize_models.MODELS:
        pytest.fail(f"--parallelize {spec}: model must be one of {parallelize_models.MODELS}, got {model!r}", pytrace=False)
    # torchtitan's form runs without torchtitan (harness/rank/parallel_dims_stand_in.py), its Llama does not: said once
    # here, not as every rank's ModuleNotFoundError
    if model != "decoder" and importlib.util.find_spec("torchtitan") is None:
        pytest.fail(
            f"--parallelize {spec}: its model {model!r} needs torchtitan, which {sys.executable} cannot import: "
            "run in torchtitan's venv (scripts/libraries --prepare torchtitan; docs/parallelize.md)",
            pytrace=False,
        )
    return form, model


def pytest_generate_tests(metafunc):
    """One test per mesh (the parity matrix: a verdict per factorisation): every mesh the function
    declares, and, skipped with the reason, every other factorisation of worlds 1 to the largest.
    Without a function, or one that cannot be loaded or declares nothing, one test whose body
    skips or fails saying why (never a collection error)."""
    if "mesh" not in metafunc.fixturenames:
        return
    try:
        spec, _, dims = declared(metafunc.config)
    except (pytest.skip.Exception, pytest.fail.Exception):
        metafunc.parametrize(
            "mesh", [pytest.param(None, id="no-function" if metafunc.config.getoption("--parallelize") is None else "the-function")]
        )
        return
    drawn, skipped = mesh_choices(dims, backend_plan(metafunc.config).max_world_size)
    params = [pytest.param(mesh, id=mesh_id(mesh)) for mesh in drawn]
    for mesh in skipped:
        missing = ", ".join(name for name, size in mesh if size > 1 and name not in dims)
        why = f"{describe_mesh(mesh)} needs {missing}, which {spec} does not declare (mesh_dims {dims})"
        params.append(pytest.param(None, id=mesh_id(mesh), marks=pytest.mark.skip(reason=why)))
    metafunc.parametrize("mesh", params)
    meshes = {mesh_id(mesh): (tuple((d, dict(mesh).get(d, 1)) for d in DIMS), "") for mesh in drawn}
    meshes.update({mesh_id(mesh): (mesh, f"needs {', '.join(n for n, s in mesh if s > 1 and n not in dims)}") for mesh in skipped})
    if not metafunc.config.pluginmanager.has_plugin(MATRIX):  # the parity matrix, from these tests' reports
        metafunc.config.pluginmanager.register(Matrix(spec, meshes, metafunc.config.getoption("--parallelize-matrix")), MATRIX)


@given(data=st.data())
def test_the_plan_trains_step_by_step_as_one_process(data, mesh, pytestconfig, ranks, target, reproduce, record_property):
    spec, function, _ = declared(pytestconfig)
    if mesh is None:
        pytest.fail(f"--parallelize {spec}: no mesh was collected for it (its declaration changed after collection?)", pytrace=False)
    form, model_kind = form_and_model(spec, function)
    example = data.draw(examples(mesh, divisible_by_tp(spec, function), model_kind), label="example")
    padding = 0.25 if example.normalisation == "global_tokens" else 0.0
    batch = decoder_lm.make_tokens(example.model, example.dp * example.per_replica, example.seq, example.data_seed, padding)
    inputs, targets = torch.tensor_split(batch["inputs"], example.dp), torch.tensor_split(batch["targets"], example.dp)
    valid = int((batch["targets"] != -100).sum())
    if form == FORM:  # torchtitan's train_step: the summed loss over the global valid-token count, gradients summed over dp
        scale = 1 / valid
    else:
        scale = None if padding == 0 else example.dp / valid
    common = {
        "function": spec,
        "base": os.getcwd(),
        "mesh": [[name, size] for name, size in example.mesh],
        "model": example.model,
        "seed": example.seed,
        "optimizer": example.optimizer,
        "steps": example.steps,
        "scale": scale,
        "form": form,
        "model_kind": model_kind,
    }
    per_rank = [
        {**common, "inputs": inputs[example.data_index(r)], "targets": targets[example.data_index(r)]} for r in range(example.world_size)
    ]
    judge = Judge(str(example), f"{reproduce} --parallelize {spec}")
    outputs = judge.run(ranks, Layout(example.world_size), PROGRAM, per_rank)
    step_judge = StepJudge(judge, example, outputs, batch, scale)
    step_judge.verdict()  # the values first: a cost never hides a wrong value (conformance/parallelize_memory.py)
    buffers = {name for name, _ in step_judge.dense.named_buffers()}
    require = pytestconfig.getoption("--require-bounds") == "yes"  # the user asks for the bound; auto and no report it
    ratio = judge_memory(judge, outputs, buffers, require, pytestconfig.stash[STATE].costs)
    record_property("memory_ratio", f"{ratio:.6g}")  # held / the placements' claim, the largest rank's, of the last example


def test_the_plans_traffic_per_mesh_dimension_against_its_placements(mesh, pytestconfig, audited_pool, target, reproduce, record_property):
    """One fixed example a mesh, run where the driver's relay carries every byte (harness/driver/
    relay.py): each step's bytes along each mesh dimension, the data-parallel ones against what the
    parameters' placements imply (conformance/parallelize_traffic.py). Its values are judged by the
    test above; a plan that fails on the ranks here is skipped, naming it, and fails there."""
    if mesh is None:  # no function, or one that cannot be graded: the test above is the one failure that says why
        pytest.skip("no mesh to measure: test_the_plan_trains_step_by_step_as_one_process says why")
    spec, function, _ = declared(pytestconfig)
    if not audited_pool.relay:
        pytest.skip(f"{target.impl} is a library's adapter, whose audited worlds run on gloo: the traffic is measured through the relay")
    form, model_kind = form_and_model(spec, function)
    example = fixed_example(mesh, divisible_by_tp(spec, function), model_kind)
    batch = decoder_lm.make_tokens(example.model, example.dp * example.per_replica, example.seq, example.data_seed, 0.0)
    inputs, targets = torch.tensor_split(batch["inputs"], example.dp), torch.tensor_split(batch["targets"], example.dp)
    common = {
        **{"function": spec, "base": os.getcwd(), "mesh": [[name, size] for name, size in example.mesh], "model": example.model},
        **{"seed": example.seed, "optimizer": example.optimizer, "steps": example.steps, "form": form, "model_kind": model_kind},
        "scale": 1 / int(batch["targets"].numel()) if form == FORM else None,
    }
    per_rank = [
        {**common, "inputs": inputs[example.data_index(r)], "targets": targets[example.data_index(r)]} for r in range(example.world_size)
    ]
    try:
        result = audited_pool.run(example.world_size, f"parallelism_conformance.harness.rank.programs.{PROGRAM}", per_rank, impl=target.impl)
    except TASK_FAILURES as failure:
        pytest.skip(
            f"the plan failed on the ranks ({str(failure).splitlines()[0][:200]}): test_the_plan_trains_step_by_step_as_one_process says why"
        )
    params = result.outputs[0].get("memory", {}).get("params")
    if params is None:
        pytest.skip("the plan returned another model, untrained here: test_the_plan_trains_step_by_step_as_one_process says so")
    ratio, shown, finding = traffic.findings(result.relayed.records, params, example.sizes, example.steps)
    record_property("traffic", traffic.describe(shown, example.steps))
    record_property("traffic_ratio", f"{ratio:.6g}")
    where = f"{example}; reproduce: {reproduce} --parallelize {spec}"
    if finding is not None and pytestconfig.getoption("--require-bounds") == "yes":
        pytest.fail(
            f"costs more than the placements imply (--require-bounds): {finding} ({traffic.describe(shown, example.steps)})\n  example: {where}",
            pytrace=False,
        )
    costs = pytestconfig.stash[STATE].costs
    if finding is not None:
        costs.append(f"costs more ({example}): {finding}")


class StepJudge:
    """The verdict on one example, from what the ranks returned (see the module docstring)."""

    def __init__(self, judge: Judge, example: Example, outputs: dict, batch: dict, scale: float | None):
        self.judge, self.example, self.outputs, self.batch, self.scale = judge, example, outputs, batch, scale
        self.dense = parallelize_models.build(example.model_kind, example.model, example.seed)
        self.initial = {name: p.detach().clone() for name, p in self.dense.named_parameters()}
        self.truth_forward = ref.forward(self.dense, batch["inputs"])
        self.rows = [torch.tensor_split(batch[key], example.dp) for key in ("inputs", "targets")]

    def verdict(self) -> None:
        example, outputs = self.example, self.outputs
        for rank in range(example.world_size):
            got = outputs[rank]
            check_names(self.judge, got["initial"], self.initial, f"rank {rank}: the parameters of the model the plan returned")
            for name, want in self.initial.items():
                self.judge.tensor(
                    got["initial"][name], want, what=f"rank {rank} parameter '{name}' before the first step ({self.where(rank, name)})"
                )
        order = self.suspects_first()
        replays = {rank: ref.Replay(example.optimizer, outputs[rank]["initial"]) for rank in range(example.world_size)}
        for s in range(example.steps):
            before = {rank: outputs[rank]["initial"] if s == 0 else outputs[rank]["params"][s - 1] for rank in range(example.world_size)}
            ref.load(self.dense, before[0])
            _, grads = ref.loss_and_grads(self.dense, self.batch["inputs"], self.batch["targets"])
            for name in order:
                for rank in range(example.world_size):
                    self.check(rank, s, name, outputs[rank]["grads"][s].get(name), grads[name], "gradient", grads, "grads")
            for rank in range(example.world_size):
                want = self.slice_loss(example.data_index(rank))
                self.check(rank, s, None, outputs[rank]["losses"][s], want, "loss", None, None)
            for rank in range(example.world_size):
                after = replays[rank].step(before[rank], outputs[rank]["grads"][s])
                for name in self.initial:
                    what = "parameter after the optimizer's step from its own parameters and gradient"
                    self.check(rank, s, name, outputs[rank]["params"][s][name], after[name], what, None, None)
                    what = "parameter after the step, against rank 0's"
                    self.check(rank, s, name, outputs[rank]["params"][s][name], outputs[0]["params"][s][name], what, None, None)

    def slice_loss(self, d: int) -> torch.Tensor:
        """Data index ``d``'s loss at the dense model's current state, as the rank computes it."""
        with torch.no_grad():
            logits = self.dense(self.rows[0][d])
        if self.scale is None:
            return ref.mean_token_loss(logits, self.rows[1][d])
        flat, labels = logits.reshape(-1, logits.shape[-1]), self.rows[1][d].reshape(-1)
        return torch.nn.functional.cross_entropy(flat, labels, ignore_index=-100, reduction="sum") * self.scale

    def check(self, rank: int, s: int, name, actual, expected, kind: str, every: dict | None, key: str | None) -> None:
        if actual is not None and not mismatch(actual, expected, ref.atol(expected)):
            return
        subject = f"'{name}' ({self.where(rank, name)})" if name else "the loss"
        what = f"step {s + 1}, rank {rank}: {kind} of {subject}"
        if every is not None:
            wrong = [n for n in every if any(mismatch(self.outputs[r][key][s].get(n), every[n], ref.atol(every[n])) for r in self.outputs)]
            what += f"; {len(wrong)} of {len(every)} parameters' {kind}s differ at this step ({', '.join(wrong[:6])}{', ...' if len(wrong) > 6 else ''})"
            what += self.across(s, name, key)
        what += self.first_divergence(rank)
        if actual is None:
            self.judge.fail(f"{what}: none (the parameter got no gradient)")
        self.judge.tensor(actual, expected, atol=ref.atol(expected), what=what)

    def across(self, s: int, name: str, key: str) -> str:
        """'; the ranks' values differ along tp' (the mesh dimensions along which two ranks that differ
        only in that coordinate hold different gathered values: a reduction over it missing or wrong),
        or that every rank holds the same value (the error is in the value all of them computed)."""
        sizes = [self.example.sizes[d] for d in DIMS]
        coords = [list(c) for c in itertools.product(*(range(n) for n in sizes))]  # init_device_mesh's row-major order
        value = lambda coord: self.outputs[coords.index(coord)][key][s].get(name)
        along = []
        for i, dim in enumerate(DIMS):
            pairs = ((c, [*c[:i], k, *c[i + 1 :]]) for c in coords if c[i] == 0 for k in range(1, sizes[i]))
            if any(a is None or b is None or mismatch(b, a, ref.atol(a)) for a, b in ((value(c), value(d)) for c, d in pairs)):
                along.append(dim)
        if len(coords) == 1:
            return ""
        if along:
            return f"; the ranks' values differ along {', '.join(along)} (not reduced over it, or not alike on its ranks)"
        return "; every rank holds the same value"

    def where(self, rank: int, name: str) -> str:
        """The mesh dims the parameter is sharded on, from its placements on this rank."""
        placements = self.outputs[rank]["placements"].get(name)
        if not placements:
            return "a plain tensor: a whole copy on this rank"
        sharded = [f"{dim} as {p}" for dim, p in placements.items() if not p.startswith("Replicate")]
        replicated = [dim for dim, p in placements.items() if p.startswith("Replicate")]
        return ("sharded on " + ", ".join(sharded) if sharded else "not sharded") + (
            f"; replicated on {', '.join(replicated)}" if replicated else ""
        )

    def diverging(self, rank: int) -> tuple[str | None, float, int]:
        """(the first module, in the order the rank's first forward ran them, whose output differs
        from the dense model's rows of this rank, or None; its largest error; how many outputs were
        shards of another shape, passed over)."""
        d = self.example.data_index(rank)
        passed_over = 0
        for path, got in self.outputs[rank]["forward"]:
            truth = self.truth_forward.get(path)
            if truth is None:
                continue
            want = torch.tensor_split(truth, self.example.dp)[d] if truth.dim() else truth
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                passed_over += 1
                continue
            if mismatch(got, want, ref.atol(want)):
                return path, float((got - want).abs().max()), passed_over
        return None, 0.0, passed_over

    def first_divergence(self, rank: int) -> str:
        """'; the first module whose forward output differs at step 1 ...', or that none does."""
        path, error, passed_over = self.diverging(rank)
        if path is not None:
            return f"; the first module whose forward output differs at step 1 on rank {rank}: '{path}' (max error {error:.3g})"
        return f"; every module's forward output at step 1 on rank {rank} matches ({passed_over} shards of another shape passed over)"

    def suspects_first(self) -> list[str]:
        """The parameter names, those of the first module whose forward differs (on the first rank
        where one does) first: where a wrong value appears is where the gradients are named from."""
        paths = (self.diverging(rank)[0] for rank in range(self.example.world_size))
        path = next((p for p in paths if p is not None), None)
        if path is None or path == "(root)":
            return list(self.initial)
        inside = [name for name in self.initial if name.startswith(path + ".")]
        return inside + [name for name in self.initial if name not in inside]
