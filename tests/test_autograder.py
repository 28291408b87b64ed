"""The autograder as a course uses it: the zip built by scripts/autograder, unpacked as Gradescope
unpacks it, installed by its setup.sh, and its run_autograder run on submissions in an emulated
grading container (harness/driver/gradescope/container.py: Docker's default capabilities, a CPU
quota, a memory limit, no network), each on a small claimed subset so the test command stays fast.
The full tier table is a benchmark (perf/test_grading_tiers.py), not a test."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from parallelism_conformance.harness.driver.gradescope import build, config, limits, precheck, run, trial
from tests.autograder_trial import TIER, grade

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
CORRECT = "from parallelism_conformance.impls import *  # noqa: F403 - the bundled implementations, handed in as a student's file\n"
# a correct submission of its author's own (written from CONTRACT.md alone): the bundled code handed in
# scores 0 (tests/test_autograder_attacks.py, class 6)
OWN = ROOT / "outsiders" / "collectives" / "c2_correct.py"


def _statuses(results: dict) -> set[str]:
    return {test["status"] for test in results["tests"]}


def test_a_correct_submission_gets_full_marks_in_the_container_within_the_courses_time_limit(installed):
    # in a subfolder, as a zip of a folder arrives; the course's limit of 5 minutes sets the budget;
    # broadcast only (2 tests), to keep the test command short
    outcome, results, _ = grade(installed, {"hw2/student_impl.py": OWN}, settings={"time_limit_s": 300, "capability": "broadcast"})
    assert outcome.returncode == 0, outcome.stdout[-3000:] + outcome.stderr[-3000:]
    assert "graded hw2/student_impl.py" in outcome.stdout, outcome.stdout[:2000]
    assert results["extra_data"]["complete"], results["output"]
    assert results["score"] == results["max_score"] == 4.0, outcome.stdout[-6000:]  # broadcast's 4 points
    assert _statuses(results) == {"passed"}
    assert "ranks contained" in results["extra_data"]["coverage"]
    assert results["extra_data"]["autograder"]["container"] == f"{min(2, os.cpu_count())} CPU, 1536 MiB"  # from inside
    assert not outcome.leftovers, f"processes outlived the run: {outcome.leftovers}"
    assert outcome.oom_kills == 0
    budget = float(re.search(r"--time-budget (\d+)", outcome.stdout).group(1))
    most = run.budget_for(config.AutograderConfig("x.py", time_limit_s=300), elapsed_s=0)
    assert 30 <= budget <= most == 210, outcome.stdout[:2000]  # 300 s less 60 s and a tenth, less what passed


def test_the_starter_scores_zero_with_every_test_not_implemented(installed):
    outcome, results, _ = grade(installed, {"student_impl.py": ROOT / "starter" / "student_impl.py"}, settings={"capability": "broadcast"})
    assert results["score"] == 0 and results["max_score"] == 4.0 and results["extra_data"]["complete"]
    assert _statuses(results) == {"failed"}
    outputs = [test["output"] for test in results["tests"]]
    assert all("not implemented" in output.lower() for output in outputs), outcome.stdout[-6000:]


def test_a_misnamed_file_is_one_failed_test_that_names_what_was_expected(installed):
    outcome, results, _ = grade(installed, {"student-impl.py": CORRECT, "notes.txt": "hi"})
    assert outcome.returncode == 0
    [test] = results["tests"]
    assert test["status"] == "failed" and results["score"] == 0 and results["max_score"] == 12.0
    assert "expected student_impl.py" in test["output"] and "Did you mean student-impl.py?" in test["output"]
    assert test["visibility"] == "visible" and results["extra_data"]["complete"]


def test_a_syntax_error_is_one_failed_test_with_its_line(installed):
    _, results, _ = grade(installed, {"student_impl.py": "import torch\n\ndef all_reduce(tensor:\n    pass\n"})
    [test] = results["tests"]
    assert test["name"] == "The submission compiles" and "student_impl.py, line 3" in test["output"], test


def test_an_import_error_is_one_failed_test_raised_in_a_contained_import(installed):
    witness = Path(tempfile.mkdtemp(prefix="conformance-import-"))
    os.chmod(witness, 0o755)
    (witness / "uid").touch(mode=0o666)  # the contained import writes who it ran as here: root's file, so
    os.chmod(witness / "uid", 0o666)  # the sweep (which removes what the import's uid made) keeps it
    source = f"import os\nopen('{witness}/uid', 'w').write(str(os.getuid()))\nimport no_such_module\n"
    _, results, _ = grade(installed, {"student_impl.py": source})
    [test] = results["tests"]
    assert test["name"] == "The submission imports", test
    assert "No module named 'no_such_module'" in test["output"] and "student_impl.py" in test["output"], test["output"]
    assert int((witness / "uid").read_text()) >= precheck.containment.UID_LOW, "the import ran as root"
    shutil.rmtree(witness)


def test_a_hanging_and_crashing_submission_gets_a_complete_report(installed):
    outcome, results, _ = grade(installed, {"student_impl.py": FIXTURES / "hanging_and_crashing_impl.py"})
    assert outcome.returncode == 0, outcome.stdout[-3000:]
    assert results["extra_data"]["complete"] and results["score"] == 0 and results["max_score"] == 12.0
    outputs = "\n".join(test["output"] for test in results["tests"])
    assert _statuses(results) == {"failed"} and "SIGSEGV" in outputs, outputs[:3000]
    # known as a deadlock at once, though the driver may not read a contained rank's /proc/<pid>/io
    # under Docker's capabilities (a reader of the ranks' uid reads it), not at the 60 s deadline
    assert "RanksDeadlocked" in outputs and "within the 60 s deadline" not in outputs, outputs[:3000]
    assert not outcome.leftovers, f"processes outlived the run: {outcome.leftovers}"


def test_a_rank_that_tries_to_become_root_stays_unprivileged_and_cannot_forge_the_grade(installed):
    log = Path(tempfile.mkdtemp(prefix="conformance-escape-")) / "escape.log"
    os.chmod(log.parent, 0o755)
    log.touch()
    os.chmod(log, 0o666)
    outcome, results, _ = grade(
        installed,
        {"student_impl.py": FIXTURES / "escaping_impl.py"},
        env={"ESCAPE_LOG": str(log), "ESCAPE_REPORT": "{root}/results"},
        settings={"capability": "broadcast"},
    )  # its broadcast tries it all too
    attempts = log.read_text()
    # a contained rank starts no process (harness/rank/syscall_filter.py): the forger never runs
    assert "become root: PermissionError" in attempts and "detach: PermissionError" in attempts, attempts
    assert "write report: PermissionError" in attempts, attempts
    # The emulation reads results.json only once no process of the run is left (it waits up to 60 s),
    # so a forger that survived (asleep for 6 s) would have rewritten it by then, had it been able to
    assert not outcome.leftovers, f"processes outlived the run: {outcome.leftovers}"
    assert results["score"] == 0 and results["max_score"] == 4.0, results["output"]
    assert results["extra_data"]["complete"]
    shutil.rmtree(log.parent)


# ------------------------------------------------------------------ without a container: fast checks
def test_the_zip_is_the_same_bytes_for_the_same_choices_and_carries_them(tmp_path):
    chosen = config.AutograderConfig(expects="hw/impl.py", capability="collectives,audit", time_limit_s=900, points_possible=100).check()
    first = build.build(chosen, ROOT / chosen.rubric, tmp_path / "a.zip")
    assert build.build(chosen, ROOT / chosen.rubric, tmp_path / "b.zip") == first
    with zipfile.ZipFile(tmp_path / "a.zip") as archive:
        names = set(archive.namelist())
        assert {"setup.sh", "run_autograder", "autograder.json", "requirements.lock", "conftest.py"} <= names
        assert not any("__pycache__" in name or name.startswith("mutants/") for name in names)
        assert (archive.getinfo("run_autograder").external_attr >> 16) & 0o111
        assert config.AutograderConfig(**json.loads(archive.read("autograder.json"))) == chosen


@pytest.mark.parametrize(
    "choices, words",
    [
        (dict(expects="impl.txt"), "expected a .py file"),
        (dict(expects="../impl.py"), "expected a .py file"),
        (dict(expects="impl.py", capability="collectivez"), "no capability or group 'collectivez'"),
        (dict(expects="impl.py", time_limit_s=3600), "60 to 2400 seconds"),
        (dict(expects="impl.py", contain_ranks="maybe"), "contain_ranks"),
        (dict(expects="impl.py", bundled_code="allow"), "bundled_code"),
    ],
)
def test_a_bad_choice_is_refused_naming_it(choices, words):
    with pytest.raises(config.ConfigError, match=re.escape(words)):
        config.AutograderConfig(**choices).check()


def test_the_suite_is_told_what_the_course_chose_of_the_submissions_reading():
    """Bundled code scores 0 unless the course chose otherwise; a reach into the grader is flagged
    unless it chose to reject it (docs/options.md: --bundled-code, --reject-grader-access)."""
    found = precheck.Found("/s/student_impl.py", {})
    default = run.suite_command(config.AutograderConfig("a.py"), found, Path("/r"), 100)
    assert default[default.index("--bundled-code") + 1] == "reject" and "--reject-grader-access" not in default
    chosen = config.AutograderConfig("a.py", bundled_code="report", reject_grader_access=True).check()
    command = run.suite_command(chosen, found, Path("/r"), 100)
    assert command[command.index("--bundled-code") + 1] == "report" and "--reject-grader-access" in command


def test_an_unknown_key_in_the_zips_choices_is_refused(tmp_path):
    (tmp_path / "autograder.json").write_text(json.dumps({"expects": "a.py", "capabilitys": "audit"}))
    with pytest.raises(config.ConfigError, match="unknown key 'capabilitys'"):
        config.load(tmp_path / "autograder.json")


def test_the_submission_is_found_where_students_put_it(tmp_path):
    expects = config.AutograderConfig(expects="student_impl.py")
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "student_impl.py").write_text("")
    assert precheck.locate(tmp_path, expects).impl == str(tmp_path / "a" / "b" / "student_impl.py")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "student_impl.py").write_text("")
    assert precheck.locate(tmp_path, expects).impl == str(tmp_path / "c" / "student_impl.py")  # the shallower
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "student_impl.py").write_text("")
    assert "found several" in precheck.locate(tmp_path, expects).message
    repository = tmp_path / "repo"
    (repository / "tests").mkdir(parents=True)
    (repository / "tests" / "adapters.py").write_text("")
    found = precheck.locate(tmp_path, config.AutograderConfig(expects=config.CS336))
    assert found.impl == "parallelism_conformance.adapters.cs336" and found.env == {"CS336_SUBMISSION": str(repository)}
    assert "tests/adapters.py at its root" in precheck.locate(tmp_path / "a", config.AutograderConfig(expects=config.CS336)).message


def test_the_budget_leaves_the_platform_time_to_start_and_report():
    default = config.AutograderConfig("a.py")
    assert run.budget_for(default, elapsed_s=0) == 480  # 600 s less 60 s and a tenth
    assert run.budget_for(default, elapsed_s=100) == 380
    assert run.budget_for(config.AutograderConfig("a.py", time_limit_s=2400), elapsed_s=0) == 2100
    assert run.budget_for(config.AutograderConfig("a.py", time_limit_s=60), elapsed_s=50) == 30  # never below


def test_the_autograder_draws_the_examples_a_students_checkout_draws(installed):
    """The grade a student reproduces is the grade they got: the autograder's Python (setup.sh, from
    the lock) and this checkout's (scripts/bootstrap.sh, from the same lock) draw the same examples."""
    command = ["-m", "parallelism_conformance.harness.driver.gradescope.draws", "30"]
    autograder = subprocess.run(
        [str(installed.venv / "bin" / "python"), *command], cwd=installed.base / "source", capture_output=True, text=True, timeout=300
    )
    checkout = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert autograder.returncode == checkout.returncode == 0, autograder.stderr[-2000:] + checkout.stderr[-2000:]
    drawn = autograder.stdout.splitlines()
    assert len(drawn) == 30 and len(set(drawn)) > 10, drawn
    assert drawn == checkout.stdout.splitlines()


@pytest.mark.parametrize(
    "lines, words",
    [
        (["einops>=0.8"], "expected a pinned package"),
        (["--index-url https://example.org"], "expected a pinned package"),
        (["torch==2.5.0"], "requirements.lock pins torch=="),
        (["einops==0.8.2", "Einops==0.8.1"], "Einops is named twice"),
    ],
)
def test_a_courses_package_that_is_not_pinned_or_changes_the_lock_is_refused(tmp_path, lines, words):
    (tmp_path / "course.txt").write_text("# the course's packages\n" + "\n".join(lines) + "\n")
    with pytest.raises(config.ConfigError, match=re.escape(words)):
        build.configure(build_arguments("--expects", "cs336", "--requirements", str(tmp_path / "course.txt")))


def build_arguments(*words: str):
    """scripts/autograder's own parser: an option it gains is in what these tests build."""
    return build.arguments().parse_args(list(words))


def test_a_cs336_autograder_carries_the_handouts_packages_by_default_and_a_course_can_name_its_own(tmp_path):
    default, _ = build.configure(build_arguments("--expects", "cs336"))
    names = {line.split("==")[0] for line in default.requirements}
    assert {"einops", "einx", "jaxtyping", "triton"} <= names, default.requirements
    assert config.AutograderConfig(**json.loads(default.to_json())) == default  # written into autograder.json
    (tmp_path / "course.txt").write_text("einops==0.8.2\n\n# comment\n")
    chosen, _ = build.configure(build_arguments("--expects", "cs336", "--requirements", str(tmp_path / "course.txt")))
    assert chosen.requirements == ("einops==0.8.2",)
    assert build.configure(build_arguments("--expects", "impl.py"))[0].requirements == ()


def test_a_2026_cs336_repository_gets_full_marks_from_the_zip_with_the_handouts_packages(installed):
    """``scripts/autograder --expects cs336``: the handout's packages are in autograder.json and in
    the image; the repository's FSDP (its layers found where its own tests import them) gets full
    marks: the live-rank cap starts from what its import measured and follows what its ranks cost
    running, and a rank the kernel kills for memory is rerun, named, never a lost point (issue 60).
    The same repository with ranks as heavy as a real 2026 one's (adapters_heavy.py) is graded at
    every tier by perf/test_grading_tiers.py ("cs336 heavy": 23 s more than this test per commit).
    Built after ``installed`` (its venv seeds this one: only the course's packages are added)."""
    chosen, _ = build.configure(build_arguments("--expects", "cs336", "--capability", "fully_sharded"))
    course = trial.install(chosen)
    try:
        graded = trial.grade(course, trial.cs336_repository(), TIER, timeout_s=900)
    finally:
        trial.remove(course)
    results, outcome = graded.results, graded.outcome
    assert results["extra_data"]["complete"] and results["score"] == results["max_score"] > 0, outcome.stdout[-6000:]
    platform = results["extra_data"]["autograder"]
    assert "layers of cs336_basics.model (tests/test_fsdp.py)" in platform["submission"], platform
    assert platform["import_mib"] is not None and platform["max_live_ranks"] >= 4, platform
    first = round(limits.first_rank_bytes(platform["import_mib"] << 20) / 2**20)
    assert f"--rank-memory {first}" in outcome.stdout  # the first estimate; the run then measures its ranks
    measured = re.search(r"largest rank (\d+) MiB measured", results["extra_data"]["memory"])
    assert measured and int(measured[1]) > platform["import_mib"], results["extra_data"]["memory"]  # the training rank, not the import
    assert not results["extra_data"]["not_graded"] and not outcome.leftovers
    assert not results["extra_data"]["memory_kills"] or outcome.oom_kills, results["extra_data"]  # a kill it names, the kernel counted


def test_the_first_live_rank_cap_follows_the_import_and_a_tier_below_the_measured_one_is_said_first():
    light, heavy = limits.live_ranks_for(1536 << 20), limits.live_ranks_for(1536 << 20, import_bytes=300 << 20)
    assert light == (1536 - 450) // 128 and heavy == (1536 - 450) // (128 + 300) < light
    assert limits.live_ranks_for(None, import_bytes=1 << 30) is None
    low, recommended = limits.ContainerLimits(0.5, 768 << 20), limits.ContainerLimits(1.0, 1536 << 20)
    assert (
        limits.tier_advice(recommended, "the CS336 set") is None
        and limits.tier_advice(limits.ContainerLimits(4, None), "every capability") is None
    )
    advice = limits.tier_advice(low, "the CS336 set")
    assert advice.startswith("this container's tier does not hold the CS336 set: 0.5 CPU (at least 1) and 768 MiB (at least 1536)")
    assert "1 vCPU / 1536 MiB grades it with full marks within 10 minutes" in advice
