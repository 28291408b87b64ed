"""``parallelism-conformance [options]`` (also ``python -m parallelism_conformance``): the conformance
suite run from any directory on the implementation ``--impl`` names, with a scorecard per
capability. Its options are the suite's (``--help`` lists them under "conformance") and pytest's;
what it prints is pytest's run of the suite's test folder.

Where it runs decides nothing but where names resolve, as ``python -m pytest`` would there: a module
name (``--impl mymodule``) is imported from the current directory first, then from the environment;
a path (``--impl path/to/impl.py``, ``--report-dir``, ``--rubric``) is relative to the current
directory; a test path that starts with ``conformance/`` (a failure's reproduce line) is the
suite's own folder. The settings of a pytest.ini, tox.ini or pyproject.toml around the current
directory (or around a virtual environment inside a project) are not read: they belong to the
user's tests, not to the suite's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# What every run of the suite passes pytest, in a checkout and installed alike. The checkout's
# pyproject.toml names the same two plugins in addopts for its own tests (tests/).
PYTEST_FLAGS = ("-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:jaxtyping")
PLUGIN = "parallelism_conformance.harness.driver.plugin.entry"
PATH_OPTIONS = ("--impl", "--report-dir", "--rubric")


def suite_root() -> Path:
    """The folder that holds the suite's ``conformance/`` (the repository root in a checkout, the
    package's folder once installed: parallelism_conformance/__init__.py)."""
    import parallelism_conformance

    for folder in map(Path, parallelism_conformance.__path__):
        if (folder / "conformance" / "conftest.py").is_file():
            return folder
    raise RuntimeError(f"no conformance/ folder beside {parallelism_conformance.__file__}: the installation is incomplete")


def _is_path(value: str) -> bool:
    return value.endswith(".py") or os.sep in value or (os.altsep is not None and os.altsep in value)


def arguments(argv: list[str], cwd: Path, root: Path) -> list[str]:
    """pytest's arguments for the command's ``argv``: paths made absolute against ``cwd`` (ranks and
    containment change directories; a name stays a name), the suite's folder as the tests to run
    unless test paths of it were named."""
    out, named_tests = [], False
    it = iter(argv)
    for arg in it:
        option, eq, value = arg.partition("=")
        if option in PATH_OPTIONS:
            if not eq:
                value = next(it, None)
                if value is None:
                    out.append(arg)  # pytest says the option lacks its value
                    break
            if option != "--impl" or _is_path(value):
                value = str(cwd / value)
            out.append(f"{option}={value}")
        elif arg == "conformance" or arg.startswith(("conformance/", "conformance::")):
            out.append(str(root / arg))
            named_tests = True
        else:
            out.append(arg)
    return [*PYTEST_FLAGS, "-p", PLUGIN, "-c", os.devnull, "--rootdir", str(root), *([] if named_tests else [str(root / "conformance")]), *out]


def main(argv: list[str] | None = None) -> int:
    cwd = Path.cwd()
    # a module --impl names is found here first, in the driver and in the ranks it starts (which
    # inherit the environment, not sys.path)
    sys.path.insert(0, str(cwd))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(cwd), os.environ.get("PYTHONPATH"))))
    import pytest

    return int(pytest.main(arguments(list(sys.argv[1:] if argv is None else argv), cwd, suite_root())))
