"""torchtitan imports triton, which it does not declare (torch's CUDA wheels bring it, its CPU ones
do not; the suite's venv installs it beside torchtitan, ``Library.extra_requirements``):

* 0.2.2's package ``__init__`` imports ``components.quantization``, whose float8 module imports
  ``models.moe``, whose ``kernels.py`` starts with ``import triton``; every torchtitan module runs
  that ``__init__`` first (the same traceback is in NixOS/nixpkgs#525257's build log of 0.2.2).
* 0.3.0's package imports without it, and so do the modules its FSDP2 and pipeline functions live in,
  but none of its models does: ``models/common/decoder.py`` imports ``models/common/moe.py``, whose
  token dispatcher imports ``distributed/minimal_async_ep``, whose ``kernels.py`` starts with
  ``import triton``.

No distributed world and no GPU are needed to see it: each module is imported in a process of its
own twice, once as installed and once with triton hidden (an import hook that answers ``No module named
'triton'``, as a CPU torch's environment does). Each such process is forked from one that imported
torch, and only torch (neither torchtitan nor triton: checked), so that torch is not imported again
twenty times (a fresh interpreter per import took 23-33 s in all). Prints what it finds and exits 0 when torchtitan
declares no triton, every listed module imports with triton and the first list fails without it at
the kernels.py named (reproduced), 1 otherwise.

    python tests/libraries/torchtitan_imports_triton.py   # in a venv with torchtitan 0.2.2 or 0.3.0 and triton
"""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import traceback

FORKABLE = False  # set in __main__, once torch is imported

# version -> (modules that need triton, the kernels.py that imports it; modules that import without it)
EXPECTED = {
    "0.2.2": (
        ["torchtitan", "torchtitan.distributed.utils", "torchtitan.distributed.pipeline_parallel", "torchtitan.models.llama3"],
        "models/moe/kernels.py",
        [],
    ),
    "0.3.0": (
        ["torchtitan.models.llama3", "torchtitan.models.common"],
        "distributed/minimal_async_ep/kernels.py",
        ["torchtitan", "torchtitan.distributed.fsdp", "torchtitan.distributed.pipeline_parallel"],
    ),
}

# a finder ahead of every other that has no triton, as an environment without the package
HIDE_TRITON = """
import sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError("No module named 'triton'", name="triton")
sys.meta_path.insert(0, NoTriton())
"""


def _in_a_fork(code: str) -> tuple[int, str]:
    """Runs ``code`` in a child forked from this process (which holds torch): its exit status and its
    traceback, as a fresh ``python -c code`` would report them."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        try:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
            status, report = 0, ""
        except BaseException:  # noqa: BLE001 - whatever the import raised is what is reported
            status, report = 1, traceback.format_exc()
        os.write(write, report.encode())
        os._exit(status)
    os.close(write)
    with os.fdopen(read) as reader:
        report = reader.read()
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), report


def _import(module: str, hide_triton: bool) -> tuple[bool, str, str]:
    code = (HIDE_TRITON if hide_triton else "") + f"import {module}"
    if FORKABLE:
        returncode, stderr = _in_a_fork(code)
    else:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        returncode, stderr = done.returncode, done.stderr
    lines = stderr.strip().splitlines() or ["(imported)"]
    # the last frame inside torchtitan: the file whose import reached triton
    origin = next((line.strip() for line in reversed(lines) if line.strip().startswith("File ") and "torchtitan" in line), "")
    return returncode == 0, lines[-1], origin


def main() -> int:
    version = importlib.metadata.version("torchtitan")
    present = importlib.util.find_spec("triton") is not None
    declared = [r for r in importlib.metadata.requires("torchtitan") or [] if r.split()[0].lower().startswith("triton")]
    print(f"torchtitan {version}; triton installed: {present}; torchtitan's requirements naming triton: {declared or 'none'}")
    if version not in EXPECTED or not present:
        print(f"not reproduced: {'no expectation for torchtitan ' + version if present else 'install triton to compare'}")
        return 1
    needing, kernels, importing = EXPECTED[version]
    as_expected = not declared
    for module in needing:
        with_triton, last_with, _ = _import(module, hide_triton=False)
        without, last, origin = _import(module, hide_triton=True)
        print(f"import {module}: with triton {last_with}; without: {last}  [{origin}]")
        as_expected &= with_triton and not without and "No module named 'triton'" in last and kernels in origin
    for module in importing:
        imported, last, _ = _import(module, hide_triton=True)
        print(f"import {module} without triton: {last}")
        as_expected &= imported
    print(f"reproduced: torchtitan {version} imports triton, which it does not declare" if as_expected else "not reproduced")
    return 0 if as_expected else 1


if __name__ == "__main__":
    import torch  # noqa: F401 - imported once, before the forks

    # a fork sees what this process imported: only where neither torchtitan nor triton came with torch
    FORKABLE = not any(name.split(".")[0] in ("torchtitan", "triton") for name in sys.modules)
    sys.exit(main())
