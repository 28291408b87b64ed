"""harness/driver/warm_pytest.py: pytest runs forked from a template that imported torch once must
say what a fresh `python -m pytest` says (exit code, output, assertion introspection), keep
concurrent runs apart, and fall back to subprocesses when the template is gone."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.driver.warm_pytest import WarmPytest

TESTS = {
    "test_passes.py": "def test_one():\n    assert 1 + 1 == 2\n",
    "test_fails.py": "def test_one():\n    x = 2\n    assert x == 1, 'x is not one'\n",
    "test_nothing.py": "X = 1\n",
    "test_crashes.py": "import os\n\ndef test_one():\n    os.kill(os.getpid(), 9)\n",
    "test_environment.py": "import os\n\ndef test_one():\n    assert os.environ.get('WARM_PYTEST_PROBE') == 'given'\n",
}


@pytest.fixture(scope="module")
def runner():
    with WarmPytest() as warm:
        yield warm


@pytest.fixture
def files(tmp_path):
    for name, text in TESTS.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def args(name):
    return [name, "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]


def test_exit_codes_and_output_are_those_of_a_fresh_pytest(runner, files):
    for name, expected in [("test_passes.py", 0), ("test_fails.py", 1), ("test_nothing.py", 5)]:
        code, output, _ = runner.run(args(name), cwd=str(files))
        fresh = subprocess.run([sys.executable, "-m", "pytest", *args(name)], cwd=files, capture_output=True, text=True)
        assert code == fresh.returncode == expected, output
        assert output.strip().splitlines()[-1].split(" in ")[0] == fresh.stdout.strip().splitlines()[-1].split(" in ")[0]
    code, output, _ = runner.run(args("test_fails.py"), cwd=str(files))
    assert "assert 2 == 1" in output and "x is not one" in output  # pytest rewrote the test's assertion
    assert "cannot be rewritten" not in output  # the template imported no plugin


def test_a_run_killed_by_a_signal_says_so(runner, files):
    code, output, _ = runner.run(args("test_crashes.py"), cwd=str(files))
    assert code == -9 and "killed by signal 9" in output


def test_concurrent_runs_keep_their_own_output(runner, files):
    names = ["test_passes.py", "test_fails.py"] * 3
    with ThreadPoolExecutor(max_workers=3) as threads:
        results = list(threads.map(lambda name: runner.run(args(name), cwd=str(files)), names))
    for name, (code, output, _) in zip(names, results):
        assert code == (0 if name == "test_passes.py" else 1)
        assert ("1 passed" in output) == (name == "test_passes.py")


def test_a_run_sees_the_environment_it_is_given_and_the_next_run_does_not(runner, files):
    assert runner.run(args("test_environment.py"), cwd=str(files), env={"WARM_PYTEST_PROBE": "given"})[0] == 0
    assert runner.run(args("test_environment.py"), cwd=str(files))[0] == 1  # each child's own: not left behind


def test_runs_go_on_as_subprocesses_when_the_template_is_gone(files):
    with WarmPytest() as warm:
        assert warm.run(args("test_passes.py"), cwd=str(files))[0] == 0
        warm._template.kill()
        warm._template.wait()
        for name, expected in [("test_passes.py", 0), ("test_fails.py", 1)]:
            code, output, _ = warm.run(args(name), cwd=str(files))
            assert code == expected, output
        assert warm.run(args("test_environment.py"), cwd=str(files), env={"WARM_PYTEST_PROBE": "given"})[0] == 0
        assert "exited" in warm._broken or "stopped reading" in warm._broken
