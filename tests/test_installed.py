"""The suite as its users get it: the wheel built from this checkout, installed into a fresh venv,
and the ``parallelism-conformance`` command run in an empty directory (no checkout on sys.path), on
the bundled implementations and on a module written in that directory, by path and by name.

The venv's dependencies (torch and the rest of the lock) are the running venv's, named by a .pth
file: a path a .pth file adds is not a site directory, so the editable install of this checkout
that the running venv holds (its own .pth and finder) is not active there."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BROKEN_BROADCAST = '''"""torch.distributed, but broadcast sends nothing: every rank keeps its own tensor."""
from torch.distributed import *  # noqa: F403


def broadcast(tensor, src, group=None, async_op=False):
    return None
'''

# a team's function (issue 57), written in the directory the command runs in, named as a module
MINE = '''"""FSDP2 on dp_shard: each block a unit, then the root."""
from torch.distributed.fsdp import fully_shard


def parallelize(model, mesh):
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    return fully_shard(model, mesh=mesh["dp_shard"])


parallelize.mesh_dims = ("dp_shard",)
'''


def _run(command: list, cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin/ folder of a fresh venv that holds the wheel and nothing of the checkout."""
    base = tmp_path_factory.mktemp("installed")
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", base / "dist", ROOT], base)
    assert built.returncode == 0, built.stdout + built.stderr
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True, check=True
    ).stdout.strip()
    Path(purelib, "suite-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    wheel = next((base / "dist").glob("*.whl"))
    done = _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], base)
    assert done.returncode == 0, done.stdout + done.stderr
    return venv / "bin"


def test_the_wheel_holds_one_top_level_name(installed):
    wheel = next((installed.parent.parent / "dist").glob("*.whl"))
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"parallelism_conformance", "parallelism_conformance-0.1.0.dist-info"}, tops
    empty = installed.parent.parent / "names"
    empty.mkdir()
    for generic in ("adapters", "conformance", "harness", "reference", "impls", "parallelize_examples"):
        imported = _run([installed / "python", "-c", f"import {generic}"], empty)
        assert "ModuleNotFoundError" in imported.stderr, (generic, imported.stderr)
    where = _run([installed / "python", "-c", "import parallelism_conformance as p; print(p.__path__)"], empty)
    assert str(installed.parent) in where.stdout and str(ROOT) not in where.stdout, where.stdout


def test_the_command_passes_the_bundled_implementations_from_an_empty_directory(installed, tmp_path):
    done = _run([installed / "parallelism-conformance", "--capability", "broadcast", "--hypothesis-profile=brief"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "conformance scorecard: parallelism_conformance.impls" in done.stdout and "broadcast       2       0" in done.stdout
    # what any pytest run leaves (Hypothesis's example database, pytest-benchmark's folder); no reports unless asked
    assert {p.name for p in tmp_path.iterdir()} <= {".hypothesis", ".benchmarks"}, list(tmp_path.iterdir())


@pytest.mark.parametrize("impl", ["mine.py", "mine"])
def test_the_command_grades_a_module_of_the_current_directory_by_path_and_by_name(installed, tmp_path, impl):
    (tmp_path / "mine.py").write_text(BROKEN_BROADCAST)
    done = _run(
        [
            installed / "parallelism-conformance",
            "--impl",
            impl,
            "--capability",
            "broadcast",
            "--hypothesis-profile=brief",
            "--report-dir",
            "out",
        ],
        tmp_path,
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "broadcast       0       2        0  FAIL" in done.stdout, done.stdout[-3000:]
    assert (tmp_path / "out" / "results.json").is_file() and (tmp_path / "out" / "summary.txt").is_file()
    reproduce = next(line for line in done.stdout.splitlines() if "reproduce: parallelism-conformance" in line)
    if impl == "mine.py":  # the printed command reruns the one test (once: the name resolves as the path did)
        rerun = _run([installed / "parallelism-conformance", *reproduce.split("reproduce: parallelism-conformance ")[1].split()], tmp_path)
        assert rerun.returncode == 1 and "1 failed" in rerun.stdout, rerun.stdout[-3000:]


def test_a_teams_parallelize_function_runs_through_the_installed_command(installed, tmp_path):
    """``parallelism-conformance --parallelize mine:parallelize`` in a fresh directory: only that
    capability runs (no --capability given), one test per mesh of worlds 1-2 (the two over dp_shard
    pass, the two it does not declare are skipped); the known plans ship in the wheel."""
    (tmp_path / "mine.py").write_text(MINE)
    command = [installed / "parallelism-conformance", "--parallelize", "mine:parallelize", "--max-world-size", "2"]
    done = _run([*command, "--hypothesis-profile=smoke", "-rs"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "4 passed, 4 skipped" in done.stdout and "capabilities: 1 pass" in done.stdout, done.stdout[-3000:]  # values and traffic, each mesh
    assert "world 2  dp_replicate=1 x dp_shard=2 x tp=1" in done.stdout and "needs tp, which mine:parallelize does not declare" in done.stdout
    shipped = "from parallelism_conformance.parallelize_examples import good, bad; print(good.fsdp_tp.mesh_dims)"
    assert "('dp_shard', 'tp')" in _run([installed / "python", "-c", shipped], tmp_path).stdout
