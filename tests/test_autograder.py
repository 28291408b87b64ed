"""The autograder as a course uses it: the zip built by scripts/autograder, unpacked as Gradescope
unpacks it, installed by its setup.sh, and its run_autograder run on submissions in an emulated
grading container (harness/driver/gradescope/container.py: Docker's default capabilities, a CPU
quota, a memory limit, no network), each on a small claimed subset so the test command stays fast.
The full tier table is a benchmark (perf/tiers.py), not a test."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from harness.driver.gradescope import build, config, container, precheck, run

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
CLAIMED = "broadcast,all_reduce"
TIER = container.Limits(cpus=1.0, memory_bytes=1536 << 20)  # Gradescope's 1 vCPU / 1.5 GB
CORRECT = "from impls import *  # noqa: F403 - the bundled implementations, handed in as a student's file\n"


def _lock_digest() -> str:
    return hashlib.sha256((ROOT / "requirements.lock").read_bytes()).hexdigest()[:12]


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """The zip built for CLAIMED, unpacked into <root>/source and installed by its own setup.sh. The
    virtual environment is kept between runs under /var/tmp, by the lock's hash, so only the first run on
    a machine downloads torch (setup.sh then finds every package installed)."""
    reason = container.unavailable(TIER)
    if reason:
        pytest.skip(f"no grading container can be emulated here: {reason}")
    base = Path(tempfile.mkdtemp(prefix="conformance-autograder-"))  # /tmp: every user may traverse it
    os.chmod(base, 0o755)
    zip_path = base / "autograder.zip"
    settings = config.AutograderConfig(expects="student_impl.py", capability=CLAIMED, suite_version="test").check()
    build.build(settings, ROOT / "grading" / "rubric.toml", zip_path)
    source = base / "source"
    with zipfile.ZipFile(zip_path) as archive:
        archive.extractall(source)
        for info in archive.infolist():  # zipfile drops the modes: Gradescope's unzip keeps them
            os.chmod(source / info.filename, (info.external_attr >> 16) & 0o777)
    venv = Path(f"/var/tmp/conformance-autograder-venv-{_lock_digest()}")
    setup = subprocess.run(["bash", str(source / "setup.sh")], capture_output=True, text=True, timeout=1800,
                           env={**os.environ, "CONFORMANCE_AUTOGRADER_VENV": str(venv), "CONFORMANCE_TORCH_INDEX": ""})
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    assert "[setup] ready: torch" in setup.stdout and "CPU build" in setup.stdout, setup.stdout
    yield base, venv
    shutil.rmtree(base, ignore_errors=True)


def grade(installed, files: dict[str, str | Path], *, limits: container.Limits = TIER,
          env: dict[str, str] | None = None, settings: dict | None = None):
    """run_autograder on a submission of ``files`` (name: text, or a file to copy), as the platform runs
    it: a fresh /autograder-like root, its own copy of run_autograder, in the emulated container.
    ``{root}`` in a value of ``env`` is that root; ``settings`` changes the course's choices."""
    base, venv = installed
    root = Path(tempfile.mkdtemp(prefix="root-", dir=base))
    os.chmod(root, 0o755)
    (root / "source").symlink_to(base / "source")
    submission = root / "submission"
    submission.mkdir()
    for name, content in files.items():
        (submission / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copy(content, submission / name)
        else:
            (submission / name).write_text(content)
    if settings:  # another course's choices: this root gets its own copy of the suite
        (root / "source").unlink()
        shutil.copytree(base / "source", root / "source", symlinks=True)
        chosen = {**json.loads((base / "source" / config.FILE_NAME).read_text()), **settings}
        (root / "source" / config.FILE_NAME).write_text(json.dumps(chosen))
    shutil.copy(base / "source" / "run_autograder", root / "run_autograder")
    outcome = container.run([str(root / "run_autograder")], limits, cwd=root, timeout_s=900,
                            env={**os.environ, "CONFORMANCE_AUTOGRADER_ROOT": str(root),
                                 "CONFORMANCE_AUTOGRADER_VENV": str(venv),
                                 **{k: v.format(root=root) for k, v in (env or {}).items()}})
    results = json.loads((root / "results" / "results.json").read_text())
    return outcome, results, root


def _statuses(results: dict) -> set[str]:
    return {test["status"] for test in results["tests"]}


def test_a_correct_submission_gets_full_marks_in_the_container(installed):
    outcome, results, _ = grade(installed, {"student_impl.py": CORRECT})
    assert outcome.returncode == 0, outcome.stdout[-3000:] + outcome.stderr[-3000:]
    assert results["extra_data"]["complete"], results["output"]
    assert results["score"] == results["max_score"] == 12.0, results["output"]  # broadcast 4 + all_reduce 8
    assert _statuses(results) == {"passed"}
    assert "ranks contained" in results["extra_data"]["coverage"]
    assert not outcome.leftovers, f"processes outlived the run: {outcome.leftovers}"
    assert outcome.oom_kills == 0


def test_the_starter_scores_zero_with_every_test_not_implemented(installed):
    _, results, _ = grade(installed, {"student_impl.py": ROOT / "starter" / "student_impl.py"})
    assert results["score"] == 0 and results["max_score"] == 12.0 and results["extra_data"]["complete"]
    assert _statuses(results) == {"failed"}
    assert all("not implemented" in test["output"].lower() for test in results["tests"]), results["tests"][0]


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
    source = "import os\nopen('/tmp/conformance-imported-as', 'w').write(str(os.getuid()))\nimport no_such_module\n"
    Path("/tmp/conformance-imported-as").unlink(missing_ok=True)
    _, results, _ = grade(installed, {"student_impl.py": source})
    [test] = results["tests"]
    assert test["name"] == "The submission imports", test
    assert "No module named 'no_such_module'" in test["output"] and "student_impl.py" in test["output"], test["output"]
    imported_as = Path("/tmp/conformance-imported-as")
    assert int(imported_as.read_text()) >= precheck.containment.UID_LOW, "the import ran as root"
    imported_as.unlink()


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
    outcome, results, root = grade(installed, {"student_impl.py": FIXTURES / "escaping_impl.py"},
                                   env={"ESCAPE_LOG": str(log), "ESCAPE_REPORT": "{root}/results"})
    attempts = log.read_text()
    assert "become root: PermissionError" in attempts and "detached pid" in attempts, attempts
    assert "write report: PermissionError" in attempts, attempts
    assert not outcome.leftovers, f"processes outlived the run: {outcome.leftovers}"
    time.sleep(7)  # past the forger's 6 s sleep: had it survived, it would have rewritten results.json now
    after = json.loads((root / "results" / "results.json").read_text())
    assert after == results and results["score"] == 4.0 and results["extra_data"]["complete"], results["output"]
    shutil.rmtree(log.parent)


def test_the_budget_comes_from_the_courses_time_limit_and_a_file_in_a_subfolder_is_found(installed):
    outcome, results, _ = grade(installed, {"hw2/student_impl.py": CORRECT}, settings={"time_limit_s": 120})
    assert "graded hw2/student_impl.py" in outcome.stdout, outcome.stdout[:2000]
    budget = float(re.search(r"--time-budget (\d+)", outcome.stdout).group(1))
    most = run.budget_for(config.AutograderConfig("x.py", time_limit_s=120), elapsed_s=0)
    assert most - 30 <= budget <= most == 48, outcome.stdout[:2000]  # 120 s less 60 s and a tenth
    assert results["extra_data"]["complete"] and results["score"] == 12.0
