"""Loading the implementation under test. Called only inside rank processes."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from types import ModuleType


class MissingDependency(RuntimeError):
    """The implementation imports a module or reads a package's metadata that this machine lacks:
    a failure that names it (the grading image, or an install step, is what is missing), never "not
    implemented", which would tell a student their code was never written."""


def load_implementation(spec: str, base: str | None = None) -> ModuleType:
    """``spec`` is an importable module name (``impls``, ``torch.distributed``, ``student_dp``) or a
    path to a .py file (relative to ``base``, default the working directory). Raises ImportError
    naming the spec when it cannot be loaded, or MissingDependency when what it imports is absent."""
    try:
        if spec.endswith(".py") or os.sep in spec:
            path = os.path.abspath(os.path.join(base or os.getcwd(), spec))
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no file {path}")
            name = "impl_under_test_" + os.path.splitext(os.path.basename(path))[0]
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            sys.path.insert(0, os.path.dirname(path))
            module_spec.loader.exec_module(module)
            return module
        return importlib.import_module(spec)
    except ModuleNotFoundError as error:  # PackageNotFoundError (importlib.metadata) is one too
        missing = error.name or ""
        if missing and not spec.endswith(".py") and (spec == missing or spec.startswith(missing + ".")):
            raise ImportError(f"could not load the implementation under test {spec!r}: {error!r}") from error
        raise MissingDependency(_dependency_message(spec, error)) from error
    except Exception as error:
        raise ImportError(f"could not load the implementation under test {spec!r}: {error!r}") from error


def _dependency_message(spec: str, error: ModuleNotFoundError) -> str:
    if isinstance(error, importlib.metadata.PackageNotFoundError):
        return (
            f"the implementation under test {spec!r} reads the installed version of {error.name!r} "
            "(importlib.metadata), which is not installed here: install it (pip install -e) before testing it"
        )
    return (
        f"the implementation under test {spec!r} imports {error.name!r}, which is not installed here: install "
        f"it where the suite runs (or into the grading image) ({error})"
    )
