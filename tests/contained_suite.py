"""The suite run as a grading run would run it, inside the emulated grading container (Docker's default
capabilities, no network: harness/driver/gradescope/container.py), for the tests of containment and
of the attacks on it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from parallelism_conformance.harness.driver.gradescope import container

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
DOCKER = container.Limits(docker_capabilities=True, network=False)


def suite_in_container(
    python: str,
    impl: str,
    *args: str,
    env: dict | None = None,
    test_file: str = "conformance/test_collectives.py",
    selected: str = "test_all_reduce and SUM",
) -> container.Outcome:
    """The collectives' all_reduce SUM test (or ``selected`` of ``test_file``), graded, run by
    ``python`` as root with Docker's default capabilities and no network."""
    command = [
        python,
        "-m",
        "pytest",
        test_file,
        "-q",
        "-p",
        "no:cacheprovider",
        "-x",
        "--impl",
        impl,
        "--hypothesis-profile=grading",
        "-k",
        selected,
        *args,
    ]
    site = [path for path in sys.path if path.endswith("site-packages")]
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *site]), **(env or {}))
    return container.run(command, DOCKER, cwd=ROOT, env=full_env, timeout_s=600)


def world_readable(path: Path) -> bool:
    return all(os.stat(parent).st_mode & 0o005 == 0o005 for parent in [path, *path.parents])


needs_emulation = pytest.mark.skipif(container.unavailable(DOCKER) is not None, reason=str(container.unavailable(DOCKER)))
needs_readable_python = pytest.mark.skipif(
    not SYSTEM_PYTHON.exists() or not world_readable(ROOT) or not world_readable(Path(__import__("torch").__path__[0])),
    reason=f"needs a world-readable {SYSTEM_PYTHON}, checkout and torch: a capability-less rank could not load them",
)
