"""torchtitan 0.2.2 does not import beside a CPU torch: ``torchtitan/__init__.py`` imports
``torchtitan.components.quantization``, whose float8 module imports ``torchtitan.models.moe``,
whose ``kernels.py`` starts with ``import triton``; triton is not among torchtitan 0.2.2's declared
requirements (it comes with torch's CUDA wheels, not with its CPU ones). Any torchtitan module a
user imports (``torchtitan.distributed.fsdp`` for FSDP2) runs the package's ``__init__`` first, so
none does. The same traceback is in NixOS/nixpkgs#525257's build log of torchtitan 0.2.2. No
distributed world is needed to see it. torchtitan 0.3.0 imports on the same torch.

Prints what it finds and exits 0 when triton is absent, undeclared, and each import fails on it
(reproduced), 1 otherwise.

    python tests/libraries/torchtitan_imports_triton.py   # in a venv with torchtitan==0.2.2, CPU torch
"""

import importlib.metadata
import importlib.util
import subprocess
import sys

MODULES = ["torchtitan", "torchtitan.distributed.fsdp", "torchtitan.distributed.pipeline_parallel"]


def main() -> int:
    version = importlib.metadata.version("torchtitan")
    absent = importlib.util.find_spec("triton") is None
    declared = [r for r in importlib.metadata.requires("torchtitan") or [] if r.split()[0].lower().startswith("triton")]
    print(f"torchtitan {version}; triton importable: {not absent}; torchtitan's requirements naming triton: {declared or 'none'}")
    failed = 0
    for module in MODULES:
        done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        lines = done.stderr.strip().splitlines() or ["(imported)"]
        origin = next((line.strip() for line in reversed(lines) if line.strip().startswith("File ")), "")
        print(f"import {module}: {lines[-1]}  [{origin}]")
        failed += done.returncode != 0 and "No module named 'triton'" in lines[-1] and "moe/kernels.py" in origin
    reproduced = absent and not declared and failed == len(MODULES)
    print("reproduced: torchtitan does not import without triton, which it does not declare" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
