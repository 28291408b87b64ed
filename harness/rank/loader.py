"""Loading the implementation under test. Called only inside rank processes."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType


def load_implementation(spec: str, base: str | None = None) -> ModuleType:
    """``spec`` is an importable module name (``impls``, ``torch.distributed``, ``student_dp``) or a
    path to a .py file (relative to ``base``, default the working directory). Raises ImportError
    naming the spec when it cannot be loaded."""
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
    except Exception as error:
        raise ImportError(f"could not load the implementation under test {spec!r}: {error!r}") from error
