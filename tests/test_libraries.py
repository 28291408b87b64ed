"""scripts/libraries' table, verdicts and document (harness/driver/libraries/), without the libraries;
then, in the venvs scripts/libraries --prepare makes (the test command makes them while tests/ runs),
every adapter on one example of each capability it maps, one pytest run per adapter, and the
standalone reproductions of tests/libraries/ (each exits 0 while the library still behaves as its
docstring says; the per-commit tier leaves them to the nightly one). A venv that was not made skips
its tests, saying so, except under CONFORMANCE_REQUIRE_LIBRARIES (.ci/run), where it fails them."""

from __future__ import annotations

import hashlib
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from parallelism_conformance.conformance import by_design
from parallelism_conformance.harness.driver import capabilities
from parallelism_conformance.harness.driver.libraries import __main__ as command
from parallelism_conformance.harness.driver.libraries.document import update, write
from parallelism_conformance.harness.driver.libraries.matrix import Verdict, _first_line, verdicts_of
from parallelism_conformance.harness.driver.libraries.table import LIBRARIES, Library, Run
from parallelism_conformance.harness.driver.libraries.venvs import (
    LOCK,
    ROOT,
    InstallFailed,
    _requirements,
    _stamp,
    base_site_packages,
    check,
    lock_lines,
    venv_of,
)

# where the test command runs (.ci/run): a library venv that is missing is a failure, not a skip
REQUIRED = bool(os.environ.get("CONFORMANCE_REQUIRE_LIBRARIES"))


def test_every_run_names_an_adapter_that_exists_and_capabilities_the_registry_knows():
    for library in LIBRARIES.values():
        assert library.pinned and library.older, f"{library.name}: a pinned version and an older one"
        for run in library.runs:
            assert (ROOT / Path(*run.adapter.removeprefix("parallelism_conformance.").split("."))).with_suffix(".py").exists(), run.adapter
            unknown = [c for c in run.capabilities if c not in capabilities.BY_NAME or c not in ONE_TEST]
            assert not unknown, f"{library.name} {run.label}: unknown capabilities {unknown}"
        versions = (library.pinned, *library.older)
        assert library.tested in versions and all(v in versions for v in library.reproductions), library.name
        assert all((ROOT / "tests" / "libraries" / f).exists() for files in library.reproductions.values() for f in files)
        # one pytest run per adapter (test_one_example_...) reads each run's capabilities from it
        by_adapter: dict[str, list[str]] = {}
        for run in library.runs:
            by_adapter.setdefault(run.adapter, []).extend(run.capabilities)
        assert all(len(caps) == len(set(caps)) for caps in by_adapter.values()), f"{library.name}: two runs of one adapter map one capability"
        for name, (what, source) in library.by_design.items():  # a design the reference can run, with its source
            assert name in by_design.KNOWN and what and source, (library.name, name)


def test_the_warm_up_and_the_suites_ranks_run_the_venvs_own_tools(tmp_path):
    """One environment for both (Venv.environment): a warm-up that ran Debian's ninja while the ranks ran
    the venv's made DeepSpeed's first audited task rebuild its op, and the audit count the build."""
    venv = venv_of(LIBRARIES["deepspeed"], LIBRARIES["deepspeed"].pinned, home=tmp_path)
    env = venv.environment({"PATH": "/usr/bin:/bin", "HOME": "/root"})
    assert env["PATH"] == f"{venv.path / 'bin'}{os.pathsep}/usr/bin:/bin" and env["HOME"] == "/root"
    assert env["TORCH_EXTENSIONS_DIR"] == str(venv.path / "torch_extensions")


def test_arguments_are_libraries_then_pytest_options():
    assert command.parse(["deepspeed==0.18.3", "-x"]) == ([("deepspeed", "0.18.3")], ["-x"], False)
    assert command.parse(["fairscale"]) == ([("fairscale", LIBRARIES["fairscale"].pinned)], [], False)
    chosen, options, whole = command.parse(["-k", "zero"])
    assert whole and options == ["-k", "zero"] and ("deepspeed", LIBRARIES["deepspeed"].older[0]) in chosen
    with pytest.raises(SystemExit, match="unknown library 'megatron'"):
        command.parse(["megatron==0.1"])


def test_help_runs_nothing_and_writes_nothing(capsys, monkeypatch):
    """scripts/libraries --help once ran the whole matrix with pytest's --help and rewrote docs/libraries.md."""

    monkeypatch.setattr(command, "run_library", lambda *a, **k: pytest.fail("--help ran a library"))
    monkeypatch.setattr(command, "write", lambda *a, **k: pytest.fail("--help wrote the document"))
    assert command.main(["--help"]) == 0 and command.main(["-h"]) == 0
    assert "scripts/libraries" in capsys.readouterr().out


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="parallelism_conformance.conformance.test_sharded_optimizer" name="test_a" file="conformance/test_sharded_optimizer.py">
  <properties><property name="capability" value="sharded_optimizer"/></properties></testcase>
<testcase classname="parallelism_conformance.conformance.test_fully_sharded" name="test_b" file="conformance/test_fully_sharded.py">
  <properties><property name="capability" value="fully_sharded"/></properties>
  <failure message="AssertionError: rank 0 'w' after step 1: expected 1.0, got 2.0">E   AssertionError
E     example: world_size=2, weight_decay=0.5
E   Falsifying example, shrunk
E     example: world_size=1, weight_decay=0.0625</failure></testcase>
<testcase classname="parallelism_conformance.conformance.test_fully_sharded" name="test_c" file="conformance/test_fully_sharded.py">
  <properties><property name="capability" value="zero2"/></properties>
  <skipped message="no drawn example ran: 10x X cannot keep parameters"/></testcase>
<testcase classname="parallelism_conformance.conformance.audit.test_sharded_optimizer" name="test_d" file="conformance/audit/test_sharded_optimizer.py">
  <properties><property name="capability" value="audit"/><property name="verdict" value="costs more"/>
  <property name="note" value="costs more (world_size=2): rank 0: sent 2192 B, more than the bound 1472 B (1.49x)"/></properties></testcase>
</testsuite></testsuites>"""


def test_a_capability_passes_fails_with_its_first_failure_or_is_refused_with_the_reason(tmp_path):
    junit = tmp_path / "run.xml"
    junit.write_text(JUNIT)
    library = Library("lib", "1.0", runs=(), explained={"test_fully_sharded.py::test_b": "a bug, shown by x.py"})
    run = Run("R", "parallelism_conformance.adapters.deepspeed", ("sharded_optimizer", "fully_sharded", "zero2"), audit=True)
    got = {v.capability: v for v in verdicts_of(junit, library, "1.0", run)}
    assert got["sharded_optimizer"].verdict == "pass"
    assert got["fully_sharded"].verdict == "fail" and "expected 1.0, got 2.0" in got["fully_sharded"].detail
    assert got["fully_sharded"].detail.endswith("(the example: world_size=1, weight_decay=0.0625)")  # the last, shrunk one
    assert got["fully_sharded"].why == "a bug, shown by x.py"
    assert got["zero2"].verdict == "refused" and "cannot keep parameters" in got["zero2"].detail
    assert got["audit"].verdict == "costs more" and "(1.49x)" in got["audit"].detail  # right values: never "fail"
    assert _first_line("E   ExceptionGroup: two ranks failed\nE   more") == "ExceptionGroup: two ranks failed"  # not "xceptionGroup"
    assert _first_line("ExceptionGroup: raised") == "ExceptionGroup: raised"
    assert got["audit"].tests["passed"] == 1 and got["audit"].tests["failed"] == 0
    doc = tmp_path / "libraries.md"
    write([*got.values(), Verdict("deepspeed", "0.0.1", "-", "-", "not installed", "pip cannot install it")], doc, "")
    text = doc.read_text()
    assert "| lib | 1.0 | R | fully_sharded | **fail** |" in text and "**not installed** | pip cannot install it" in text


def test_one_librarys_run_rewrites_its_rows_and_section_and_keeps_the_rest(tmp_path):
    libraries = {"a": Library("a", "2", runs=(), older=("1",)), "b": Library("b", "1", runs=(), explained={"x": "why x"})}
    doc = tmp_path / "libraries.md"
    old = [
        Verdict("a", "2", "R", "c", "pass", "1 passed"),
        Verdict("a", "1", "R", "c", "pass"),
        Verdict("b", "1", "-", "-", "not installed", "pip"),
    ]
    write(old, doc, "", libraries)
    doc.write_text(doc.read_text().replace("## a\n", "## a\n\nA note written by hand.\n"))
    update([Verdict("b", "1", "S", "c", "fail", "it failed", why="why x")], doc, "-x", libraries)
    text = doc.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| a |") or line.startswith("| b |")]
    assert rows[:2] == ["| a | 2 | R | c | **pass** | 1 passed |  |", "| a | 1 | R | c | **pass** |  |  |"]
    assert rows[2:] == ["| b | 1 | S | c | **fail** | it failed | why x |"], rows
    assert "A note written by hand." in text and "- `x`: why x" in text and "Rows of b 1 last run:" in text and "`-x`" in text
    assert text.index("## a") < text.index("## b") and text.count("## b") == 1
    update([Verdict("a", "1", "R", "c", "refused", "no test ran")], doc, "", libraries)
    update([Verdict("a", "2", "R", "c", "fail", "worse")], doc, "-k x", libraries)
    text = doc.read_text()
    assert text.index("Rows of a 2 last run:") < text.index("Rows of a 1 last run:") < text.index("## b"), text
    assert "| a | 2 | R | c | **fail** | worse |" in text and "| a | 1 | R | c | **refused** |" in text and "A note" not in text


def test_a_librarys_ranks_preload_what_its_entry_names():
    from parallelism_conformance.harness.rank.preload import PRELOAD, with_library_modules

    assert with_library_modules({}) == list(PRELOAD)
    assert with_library_modules({"CONFORMANCE_RANK_PRELOAD": "a, b,,torch"}) == [*PRELOAD, "a", "b"]
    named = LIBRARIES["torchtitan"].environment["CONFORMANCE_RANK_PRELOAD"].split(",")
    assert named and all(name.startswith("torchtitan.") for name in named)


def test_a_librarys_venv_leaves_out_only_the_lock_lines_its_entry_names():
    kept = lock_lines(Library("x", "1", runs=(), unconstrained={"fsspec": "why"}))
    assert "fsspec==" not in kept and "torch==" in kept and len(kept.splitlines()) == len(LOCK.read_text().splitlines()) - 1
    assert lock_lines(LIBRARIES["deepspeed"]) == LOCK.read_text()
    with pytest.raises(InstallFailed, match="torch cannot be left out"):
        lock_lines(Library("x", "1", runs=(), unconstrained={"torch": "no"}))


def test_a_librarys_extra_requirements_are_installed_and_stamped_with_it(tmp_path):
    plain = venv_of(Library("x", "1", runs=()), "1", home=tmp_path)
    extra = venv_of(Library("x", "1", runs=(), extra_requirements=("triton==3.6.0",)), "1", home=tmp_path)
    assert _requirements(plain) == ["x==1"] and _requirements(extra) == ["x==1", "triton==3.6.0"]
    # a venv made before the extra requirement was named is made again; one without any keeps its stamp,
    # which names the lock, the requirements and the base venv's site-packages the venv sees
    assert _stamp(extra) != _stamp(plain)
    base = "\n".join(base_site_packages()).encode()
    assert _stamp(plain).name == ".libraries-installed-" + hashlib.sha1(LOCK.read_text().encode() + b"x==1" + base).hexdigest()[:12]
    assert "triton==3.6.0" in LIBRARIES["torchtitan"].extra_requirements


def test_a_version_that_does_not_install_carries_the_tables_explanation(tmp_path, monkeypatch):
    from parallelism_conformance.harness.driver.libraries import matrix

    def refuse(venv, log):
        raise InstallFailed("no")

    monkeypatch.setattr(matrix, "ensure", refuse)
    library = Library("lib", "2", runs=(), older=("1",), explained={"lib 1": "one's reason", "lib": "any version's"})
    assert [v.why for v in matrix.run_library(library, "1", [], tmp_path, log=lambda _: None)] == ["one's reason"]
    assert [v.why for v in matrix.run_library(library, "2", [], tmp_path, log=lambda _: None)] == ["any version's"]


def test_a_version_that_does_not_import_is_one_line(tmp_path):
    fake = tmp_path / "nolib-9.9" / "bin"
    fake.mkdir(parents=True)
    (fake / "python").write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named nolib' >&2\nexit 1\n")
    (fake / "python").chmod(0o755)
    venv = venv_of(Library("nolib", "9.9", runs=()), "9.9", home=tmp_path)
    with pytest.raises(InstallFailed, match="nolib==9.9 does not import: ModuleNotFoundError: No module named nolib"):
        check(venv)


def _made(library: Library, version: str):
    """The library's venv at ``version``, made by scripts/libraries (--prepare): skipped where it was
    not, except where the test command requires it (CONFORMANCE_REQUIRE_LIBRARIES)."""
    venv = venv_of(library, version)
    if not list(venv.path.glob(".libraries-installed-*")) and not (version != library.tested and venv.python.exists()):
        why = f"{library.name}=={version} has no venv here: scripts/libraries --prepare {library.name} makes it"
        if REQUIRED:
            pytest.fail(why + " (CONFORMANCE_REQUIRE_LIBRARIES is set: the test command prepares every one)")
        pytest.skip(why)
    return venv


ONE_TEST = {  # per capability a library maps: the test that trains through the contract's loop
    "data_parallel": "conformance/test_data_parallel.py::test_gradients_are_the_mean_over_ranks",
    "sharded_optimizer": "conformance/test_sharded_optimizer.py::test_sharded_training_matches_one_process_with_the_whole_state",
    "fully_sharded": "conformance/test_fully_sharded.py::test_training_matches_one_process_and_memory_is_sharded",
    "zero2": "conformance/test_fully_sharded.py::test_zero2_training_matches_one_process_and_memory_is_sharded",
    # the model-parallel libraries (issue 47): the layer's forward and backward, or the step, against the dense one
    "tensor_parallel": "conformance/test_tensor_parallel.py::test_sequence_parallel_mlp_equals_the_dense_mlp",
    "tp_norm": "conformance/test_tensor_parallel.py::test_a_layernorm_before_the_mlp_keeps_whole_gradients",
    "vocab_parallel": "conformance/test_vocab_parallel.py::test_the_loss_and_its_gradient_equal_the_dense_cross_entropy",
    "vocab_label_smoothing": "conformance/test_vocab_parallel.py::test_label_smoothing_spreads_over_the_whole_vocabulary",
    # DeepSpeed's bf16 / fp16 flag behind the contract's compute_dtype (issue 56)
    "dp_compute_dtype": "conformance/test_data_parallel.py::test_compute_dtype_in_data_parallelism_keeps_float32_masters",
    "tp_dropout": "conformance/test_tp_dropout.py::test_tensor_parallel_dropout_is_the_dense_dropout",
    "tp_compute_dtype": "conformance/test_tp_compute_dtype.py::test_the_sequence_parallel_bias_gradient_is_summed_in_the_masters_dtype",
    "pipeline_parallel": "conformance/test_pipeline_parallel.py::test_pipeline_step_matches_the_dense_model",
    # torchtitan's (issue 47): its loss normalised by the global token count, through FSDP2 and through its pipeline
    "token_loss": "conformance/test_token_loss.py::test_fully_sharded_gradients_are_the_mean_over_every_valid_token",
    "pipeline_token_loss": "conformance/test_pipeline_parallel.py::test_a_loss_normalised_by_the_valid_rows_sums_the_microbatches",
}
ADAPTERS = [
    (library, adapter, [run for run in library.runs if run.adapter == adapter])
    for library in LIBRARIES.values()
    for adapter in dict.fromkeys(run.adapter for run in library.runs)
]


@pytest.mark.parametrize("library,adapter,runs", ADAPTERS, ids=[f"{lib.name}-{adapter.split('.')[-1]}" for lib, adapter, _ in ADAPTERS])
def test_one_example_of_each_mapped_capability_runs_in_the_librarys_venv(library, adapter, runs, tmp_path):
    """Each capability's training test that the adapter's runs map, one drawn example each (the
    ``smoke`` profile), in one pytest run in the venv of the version the test command tests: every
    capability must end in a verdict the matrix explains, never a crash of the suite. One run per
    adapter, not per capability: a run's fixed cost (pytest, the library imported in the ranks) was
    most of a one-example run's 5-12 s."""
    venv = _made(library, library.tested)
    junit = tmp_path / "one.xml"
    capabilities = [c for run in runs for c in run.capabilities]
    done = subprocess.run(
        [
            str(venv.python),
            "-m",
            "pytest",
            *dict.fromkeys(ONE_TEST[c] for c in capabilities),
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "--impl",
            adapter,
            "--capability",
            ",".join(capabilities),
            "--hypothesis-profile=smoke",
            "--max-world-size",
            "2",
            f"--junitxml={junit}",
            "-q",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=venv.environment(dict(os.environ)),
        timeout=600,
    )
    assert junit.exists(), done.stdout[-3000:] + done.stderr[-2000:]
    verdicts = [v for run in runs for v in verdicts_of(junit, library, library.tested, Run(run.label, adapter, run.capabilities, audit=False))]
    assert len(verdicts) == len(capabilities) and all(v.verdict in ("pass", "fail", "refused") for v in verdicts), verdicts
    unexplained = [v for v in verdicts if v.verdict == "fail" and not v.why]
    assert not unexplained, textwrap.shorten(f"unexplained failure of {unexplained[0].capability}: {unexplained[0].detail}", 1500)
    missing = [v.capability for v in verdicts if v.detail == "no test ran"]
    assert not missing, f"no test ran for {missing}: ONE_TEST names a test the capability does not select"


REPRODUCTIONS = [
    (library, version, script) for library in LIBRARIES.values() for version, scripts in library.reproductions.items() for script in scripts
]


@pytest.mark.parametrize("library,version,script", REPRODUCTIONS, ids=[f"{lib.name}=={v}-{script}" for lib, v, script in REPRODUCTIONS])
def test_each_standalone_reproduction_still_reproduces(library, version, script):
    venv = _made(library, version)  # a version that does not import (nanotron 0.4) has its venv but never the stamp
    done = subprocess.run(
        [str(venv.python), str(ROOT / "tests" / "libraries" / script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=venv.environment(dict(os.environ)),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "reproduced" in done.stdout


def test_capability_narrows_each_run_to_what_it_maps_and_rewrites_only_those_rows(tmp_path):
    from parallelism_conformance.harness.driver.libraries.matrix import asked_capabilities, narrowed

    asked, rest = asked_capabilities(["--capability", "sharded_optimizer", "-x", "--hypothesis-profile=brief"])
    assert asked == {"sharded_optimizer"} and rest == ["-x", "--hypothesis-profile=brief"]
    assert asked_capabilities(["--capability=a,audit"])[0] == {"a", "audit"} and asked_capabilities(["-x"]) == (None, ["-x"])
    zero1 = Run("ZeRO-1", "parallelism_conformance.adapters.deepspeed", ("sharded_optimizer",), audit=True)
    zero3 = Run("ZeRO-3", "parallelism_conformance.adapters.deepspeed", ("fully_sharded", "zero2"), audit=True)
    assert narrowed(zero1, asked) == Run("ZeRO-1", zero1.adapter, ("sharded_optimizer",), False)  # its own, not every run's
    assert narrowed(zero3, asked) is None  # maps none of them: not run, never "refused"
    assert narrowed(zero3, None) is zero3
    libraries = {"a": Library("a", "2", runs=())}
    doc = tmp_path / "libraries.md"
    write(
        [Verdict("a", "2", "R", "c", "pass"), Verdict("a", "2", "R", "audit", "pass"), Verdict("a", "2", "S", "d", "pass")], doc, "", libraries
    )
    update([Verdict("a", "2", "R", "c", "fail", "now")], doc, "--capability c", libraries, narrowed=True)
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| a |")]
    assert "| a | 2 | R | c | **fail** | now |  |" in rows and "| a | 2 | R | audit | **pass** |  |  |" in rows and len(rows) == 3, rows
    # the whole run's line stays (the other rows are its), the narrowed rerun said after it, once
    update([Verdict("a", "2", "R", "c", "pass", "again")], doc, "--capability c", libraries, narrowed=True)
    (said,) = [line for line in doc.read_text().splitlines() if line.startswith("Rows of a 2 last run:")]
    assert said.count("rerun alone since: the c rows") == 1 and "`--capability c`" in said, said


def test_explain_rewrites_a_failed_rows_why_from_the_table_and_keeps_its_verdict(tmp_path):
    """scripts/libraries --explain: once a standalone reproduction shows a failure to be the library's, the
    table's new words reach the rows a run wrote, without running the library again."""
    from parallelism_conformance.harness.driver.libraries.document import explain

    run = Run("R", "parallelism_conformance.adapters.deepspeed", ("c",), audit=False)
    doc = tmp_path / "libraries.md"
    before = Library("a", "2", runs=(run,), explained={"t.py::test_x": "the suite's own until shown"})
    write([Verdict("a", "2", "R", "c", "fail", "t.py::test_x: AssertionError: off", why="the suite's own until shown")], doc, "", {"a": before})
    after = Library("a", "2", runs=(run,), explained={"t.py::test_x": "a finding, shown by x.py"})
    assert explain(doc, {"a": after}) == 1
    (row,) = [line for line in doc.read_text().splitlines() if line.startswith("| a |")]
    assert row == "| a | 2 | R | c | **fail** | t.py::test_x: AssertionError: off | a finding, shown by x.py |", row
    assert explain(doc, {"a": after}) == 0  # nothing left to change


def test_a_run_says_how_long_its_last_run_with_the_same_options_took(tmp_path):
    from parallelism_conformance.harness.driver.libraries.document import expected_time

    doc = tmp_path / "libraries.md"
    doc.write_text("Rows of a 2 last run: 2026-12-07, with pytest options `--hypothesis-profile=brief`, 590 s for the runs.\n")
    assert "with these options took 590 s" in expected_time(doc, "a", "2", "--hypothesis-profile=brief")
    assert "with other options" in expected_time(doc, "a", "2", "-x")
    assert "no estimate" in expected_time(doc, "a", "3", "")
