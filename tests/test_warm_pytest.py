"""harness/driver/warm_pytest.py: pytest runs forked from a template that imported torch once must
say what a fresh `python -m pytest` says (exit code, output, assertion introspection), keep
concurrent runs apart, end a run past its timeout, fork every run's ranks from the template's one
forkserver with the run's own environment, and fall back to subprocesses when the template is gone."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from parallelism_conformance.harness.driver.warm_pytest import WarmPytest
from parallelism_conformance.harness.rank.preload import PRELOAD

TESTS = {
    "test_passes.py": "def test_one():\n    assert 1 + 1 == 2\n",
    "test_fails.py": "def test_one():\n    x = 2\n    assert x == 1, 'x is not one'\n",
    "test_nothing.py": "X = 1\n",
    "test_crashes.py": "import os\n\ndef test_one():\n    os.kill(os.getpid(), 9)\n",
    "test_environment.py": "import os\n\ndef test_one():\n    assert os.environ.get('WARM_PYTEST_PROBE') == 'given'\n",
    "test_sleeps.py": "import time\n\ndef test_one():\n    time.sleep(600)\n",
}
# A rank program's view, through an implementation's all_reduce: its parent (the forkserver) and the
# variable the run was given, appended to PROBE_FILE.
PROBING_IMPL = """import os
import torch.distributed as dist
from torch.distributed import *  # noqa: F401,F403


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    with open(os.environ["PROBE_FILE"], "a") as probe:
        probe.write(f"{os.getppid()} {os.environ.get('WARM_PYTEST_PROBE')}\\n")
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
"""
RANKS_TEST = """import torch
from parallelism_conformance.harness.driver.pool import WorldPool


def test_ranks():
    task = {{"function": "all_reduce", "arguments": {{"tensor": torch.ones(2)}}, "group": None}}
    with WorldPool("gloo", timeout_s=60.0) as pool:
        pool.run(2, "parallelism_conformance.harness.rank.programs.collectives:call", [task] * 2, impl={impl!r})
"""


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


def test_a_run_past_its_timeout_is_killed_and_says_so(files):
    with WarmPytest() as fresh:  # its first run: the timeout counts from the fork, not while torch imports
        code, output, _ = fresh.run(args("test_sleeps.py"), cwd=str(files), timeout_s=2)
    assert code == -9 and "killed by signal 9, past its 2 s timeout" in output, output


def test_every_runs_ranks_come_from_one_forkserver_with_the_runs_own_environment(tmp_path):
    (tmp_path / "probing_impl.py").write_text(PROBING_IMPL)
    (tmp_path / "test_ranks.py").write_text(RANKS_TEST.format(impl=str(tmp_path / "probing_impl.py")))
    probe = tmp_path / "probe.txt"
    with WarmPytest(forkserver_preload=PRELOAD) as warm:
        for value in ("first", "second"):
            code, output, _ = warm.run(args("test_ranks.py"), cwd=str(tmp_path), env={"WARM_PYTEST_PROBE": value, "PROBE_FILE": str(probe)})
            assert code == 0, output
    seen = [line.split() for line in probe.read_text().splitlines()]
    assert [value for _, value in seen] == ["first", "first", "second", "second"]  # 2 ranks per run
    assert len({parent for parent, _ in seen}) == 1  # one forkserver forked them all


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
