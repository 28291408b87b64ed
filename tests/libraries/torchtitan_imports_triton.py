"""torchtitan imports triton, which it does not declare (torch's CUDA wheels bring it, its CPU ones
do not), so beside a CPU torch:

* 0.2.2 does not import at all: ``torchtitan/__init__.py`` imports ``components.quantization``,
  whose float8 module imports ``models.moe``, whose ``kernels.py`` starts with ``import triton``;
  every torchtitan module runs that ``__init__`` first (the same traceback is in NixOS/nixpkgs#525257's
  build log of 0.2.2).
* 0.3.0 imports, and so do the modules its FSDP2 and pipeline functions live in, but none of its
  models does: ``models/common/decoder.py`` imports ``models/common/moe.py``, whose token dispatcher
  imports ``distributed/minimal_async_ep``, whose ``kernels.py`` starts with ``import triton``; so
  ``parallelize_llama`` and ``pipeline_llm`` cannot be given torchtitan's own Llama.

No distributed world is needed to see it. Prints what it finds and exits 0 when triton is absent and
undeclared and each module fails (or imports) as listed for the installed version (reproduced), 1
otherwise.

    python tests/libraries/torchtitan_imports_triton.py   # in a venv with torchtitan 0.2.2 or 0.3.0, CPU torch
"""

import importlib.metadata
import importlib.util
import subprocess
import sys

# version -> (modules that fail on triton, at the kernels.py named; modules that import)
EXPECTED = {
    "0.2.2": (
        ["torchtitan", "torchtitan.distributed.fsdp", "torchtitan.distributed.pipeline_parallel"],
        "models/moe/kernels.py",
        [],
    ),
    "0.3.0": (
        ["torchtitan.models.llama3", "torchtitan.models.common"],
        "distributed/minimal_async_ep/kernels.py",
        ["torchtitan", "torchtitan.distributed.fsdp", "torchtitan.distributed.pipeline_parallel"],
    ),
}


def _import(module: str) -> tuple[bool, str, str]:
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    lines = done.stderr.strip().splitlines() or ["(imported)"]
    origin = next((line.strip() for line in reversed(lines) if line.strip().startswith("File ")), "")
    return done.returncode == 0, lines[-1], origin


def main() -> int:
    version = importlib.metadata.version("torchtitan")
    absent = importlib.util.find_spec("triton") is None
    declared = [r for r in importlib.metadata.requires("torchtitan") or [] if r.split()[0].lower().startswith("triton")]
    print(f"torchtitan {version}; triton importable: {not absent}; torchtitan's requirements naming triton: {declared or 'none'}")
    if version not in EXPECTED:
        print(f"not reproduced: no expectation for torchtitan {version}")
        return 1
    failing, kernels, importing = EXPECTED[version]
    as_expected = absent and not declared
    for module in failing:
        imported, last, origin = _import(module)
        print(f"import {module}: {last}  [{origin}]")
        as_expected &= not imported and "No module named 'triton'" in last and kernels in origin
    for module in importing:
        imported, last, _ = _import(module)
        print(f"import {module}: {last}")
        as_expected &= imported
    print(f"reproduced: torchtitan {version} needs triton, which it does not declare" if as_expected else "not reproduced")
    return 0 if as_expected else 1


if __name__ == "__main__":
    sys.exit(main())
