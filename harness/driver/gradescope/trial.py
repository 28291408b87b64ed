"""The autograder tried as the platform runs it, on this machine: the zip built (build.py), unpacked
as Gradescope unpacks it into ``<base>/source``, installed by its own setup.sh, and its
run_autograder run on a submission in an emulated container (container.py). Used by
tests/test_autograder.py and the tier benchmark (perf/test_grading_tiers.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from parallelism_conformance.harness.driver.gradescope import build, container
from parallelism_conformance.harness.driver.gradescope.config import FILE_NAME, AutograderConfig

SUITE = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Installed:
    base: Path  # holds source/ (the unpacked zip); world-traversable, as the platform's /autograder
    venv: Path  # what setup.sh installed


@dataclass(frozen=True)
class Symlink:
    """A file of a trial's submission that is a symbolic link to ``target`` (as a zip can carry one)."""

    target: str | Path


@dataclass(frozen=True)
class Graded:
    outcome: container.Outcome
    results: dict  # results.json as the platform reads it when the run ends
    root: Path  # the run's /autograder


def venv_for_this_lock(course_packages: tuple[str, ...] = ()) -> Path:
    """Where setup.sh installs for trials: kept between runs by the hash of the lock and the course's
    packages, so only the first trial on a machine downloads torch (setup.sh then finds every
    package installed), and a zip without the course's packages never finds them installed."""
    digest = hashlib.sha256((SUITE / "requirements.lock").read_bytes() + "\n".join(course_packages).encode())
    return Path(f"/var/tmp/conformance-autograder-venv-{digest.hexdigest()[:12]}")


def install(config: AutograderConfig, venv: Path | None = None) -> Installed:
    """Build the zip for ``config``, unpack it and run its setup.sh (which must end "ready")."""
    base = Path(tempfile.mkdtemp(prefix="conformance-autograder-"))  # under /tmp: every user may traverse it
    os.chmod(base, 0o755)
    zip_path = base / "autograder.zip"
    build.build(config, SUITE / config.rubric, zip_path)
    source = base / "source"
    with zipfile.ZipFile(zip_path) as archive:
        archive.extractall(source)
        for info in archive.infolist():  # zipfile drops the modes; the platform's unzip keeps them
            os.chmod(source / info.filename, (info.external_attr >> 16) & 0o777)
    venv = venv or venv_for_this_lock(config.requirements)
    plain = venv_for_this_lock()
    if config.requirements and not venv.exists() and (plain / "bin" / "python").exists():
        # seeded from the lock's venv of earlier trials (a venv moved whole still runs by its own
        # bin/python): setup.sh then adds only the course's packages, not torch again
        subprocess.run(["cp", "-a", str(plain), str(venv)], check=True, timeout=600)
    setup = subprocess.run(
        ["bash", str(source / "setup.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "CONFORMANCE_AUTOGRADER_VENV": str(venv), "CONFORMANCE_TORCH_INDEX": ""},
    )
    if setup.returncode != 0 or "[setup] ready: torch" not in setup.stdout:
        raise RuntimeError(f"setup.sh failed (exit {setup.returncode}):\n{setup.stdout[-3000:]}\n{setup.stderr[-3000:]}")
    return Installed(base, venv)


def grade(
    installed: Installed,
    files: dict[str, str | Path | Symlink],
    limits: container.Limits,
    *,
    env: dict[str, str] | None = None,
    settings: dict | None = None,
    timeout_s: float = 3000,
) -> Graded:
    """run_autograder on a submission of ``files`` (name: text, a file to copy, or a Symlink) in a fresh
    /autograder-like root with its own copy of run_autograder, in the emulated container. ``{root}``
    in a value of ``env`` is that root; ``settings`` changes the course's choices (autograder.json)
    for this run only."""
    root = Path(tempfile.mkdtemp(prefix="root-", dir=installed.base))
    os.chmod(root, 0o755)
    if settings:
        shutil.copytree(installed.base / "source", root / "source", symlinks=True)
        chosen = {**json.loads((root / "source" / FILE_NAME).read_text()), **settings}
        (root / "source" / FILE_NAME).write_text(json.dumps(chosen))
    else:
        (root / "source").symlink_to(installed.base / "source")
    submission = root / "submission"
    submission.mkdir()
    for name, content in files.items():
        (submission / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Symlink):
            (submission / name).symlink_to(content.target)
        elif isinstance(content, Path):
            shutil.copy(content, submission / name)
        else:
            (submission / name).write_text(content)
    shutil.copy(installed.base / "source" / "run_autograder", root / "run_autograder")
    outcome = container.run(
        [str(root / "run_autograder")],
        limits,
        cwd=root,
        timeout_s=timeout_s,
        env={
            **os.environ,
            "CONFORMANCE_AUTOGRADER_ROOT": str(root),
            "CONFORMANCE_AUTOGRADER_VENV": str(installed.venv),
            **{k: v.format(root=root) for k, v in (env or {}).items()},
        },
    )
    try:
        results = json.loads((root / "results" / "results.json").read_text())
    except (OSError, ValueError) as error:
        raise RuntimeError(
            f"run_autograder left no readable results.json ({error}); exit {outcome.returncode}:\n"
            f"{outcome.stdout[-3000:]}\n{outcome.stderr[-3000:]}"
        ) from None
    return Graded(outcome, results, root)


CS336_FIXTURE = SUITE / "tests" / "fixtures" / "cs336_submission"


def cs336_repository(adapters: str = "adapters_newer.py") -> dict[str, Path]:
    """The project's CS336 submission as a 2026 student hands it in, for :func:`grade`: the
    repository with its tests/adapters.py (the 2026 names), its cs336_basics on einops, einx and
    jaxtyping, and its flash attention on triton. ``adapters_heavy.py``: the same entry points, with
    ranks as heavy as a real repository's while they train (it imports adapters_newer.py beside it)."""
    variants = ("adapters.py", "adapters_newer.py", "adapters_heavy.py")
    files = {
        str(p.relative_to(CS336_FIXTURE)): p
        for p in CS336_FIXTURE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name not in variants
    }
    if adapters == "adapters_heavy.py":
        files["tests/adapters_newer.py"] = CS336_FIXTURE / "tests" / "adapters_newer.py"
    return {**files, "tests/adapters.py": CS336_FIXTURE / "tests" / adapters}


def remove(installed: Installed) -> None:
    shutil.rmtree(installed.base, ignore_errors=True)
