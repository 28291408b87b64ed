"""The submission's own distributions made visible to ``importlib.metadata`` as if it had been
installed, without installing it: the 2026 template's ``cs336_systems/__init__.py`` reads
``importlib.metadata.version("cs336-systems")`` at import and fails until the package is installed,
and installing would run the submission's build backend (its code) in the grader. Here the name and
version are read from each ``pyproject.toml`` (the submission's root and ``cs336-basics/``) with
``tomllib`` and served by a finder on ``sys.meta_path``; nothing is built, run or written. A
distribution that is installed for real is left to it. ``python_mismatch`` says when the
submission asks for a newer Python than the grader's (the 2026 template asks for 3.12 or later),
for the error of code that does not parse here."""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
import tomllib

FOLDERS = ("", "cs336-basics")  # the template's packages, relative to the submission's root


class _Declared(importlib.metadata.Distribution):
    def __init__(self, name: str, version: str, folder: str):
        self._metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        self._folder = folder

    def read_text(self, filename):
        return self._metadata if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path):
        return os.path.join(self._folder, path)


class _DeclaredFinder:
    """A meta-path finder that finds no modules, only the declared distributions."""

    def __init__(self, distributions: dict[str, _Declared]):
        self.distributions = distributions

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        wanted = _normal(name) if name else None
        return iter([d for key, d in self.distributions.items() if wanted in (None, key)])


def _normal(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def declare(root: str) -> list[str]:
    """Make the distributions the submission under ``root`` declares (and has not installed)
    resolvable; returns 'name version' of each one added."""
    found: dict[str, _Declared] = {}
    for folder in (os.path.join(root, f) if f else root for f in FOLDERS):
        try:
            with open(os.path.join(folder, "pyproject.toml"), "rb") as file:
                project = tomllib.load(file).get("project", {})
        except (OSError, tomllib.TOMLDecodeError):
            continue
        name, version = project.get("name"), project.get("version")
        if not isinstance(name, str) or not isinstance(version, str):
            continue
        try:
            importlib.metadata.version(name)
            continue  # installed for real
        except importlib.metadata.PackageNotFoundError:
            found[_normal(name)] = _Declared(name, version, folder)
    if found:
        sys.meta_path.append(_DeclaredFinder(found))
    return [f"{d.metadata['Name']} {d.version}" for d in found.values()]


def python_mismatch(root: str) -> str:
    """'; it asks for Python >=3.12 (requires-python in pyproject.toml)' when the submission's
    lower bound is above the running Python (the 2026 template's is), else ''."""
    try:
        with open(os.path.join(root, "pyproject.toml"), "rb") as file:
            wanted = tomllib.load(file).get("project", {}).get("requires-python", "")
    except (OSError, tomllib.TOMLDecodeError):
        return ""
    lower = re.search(r">=\s*(\d+)\.(\d+)", wanted) if isinstance(wanted, str) else None
    if lower and (int(lower[1]), int(lower[2])) > sys.version_info[:2]:
        return f"; it asks for Python {wanted} (requires-python in its pyproject.toml): grade it with that Python"
    return ""
