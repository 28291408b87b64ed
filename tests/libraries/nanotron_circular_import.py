"""nanotron 0.4 as the package index serves it does not import: ``nanotron/logging.py`` imports
``nanotron.config.config`` (LoggingArgs), whose imports reach ``nanotron/parallel/pipeline_parallel/
engine.py``, which imports ``log_rank`` from the half-initialised ``nanotron.logging``
(upstream huggingface/nanotron#191 and #235). No order of imports breaks the cycle: each module on it,
imported first, fails. No distributed world is needed to see it.

Prints each try and exits 0 when every one fails with the circular ImportError (reproduced), 1 otherwise.

    python tests/libraries/nanotron_circular_import.py   # in a venv with nanotron==0.4
"""

import subprocess
import sys

FIRST = [
    "nanotron.logging",
    "nanotron.config",
    "nanotron.parallel.pipeline_parallel.engine",
    "nanotron.parallel.tensor_parallel.nn",
    "nanotron.optim.zero",
]


def main() -> int:
    circular = 0
    for module in FIRST:
        done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        last = (done.stderr.strip().splitlines() or ["(imported)"])[-1]
        print(f"import {module}: {last}")
        circular += done.returncode != 0 and "circular import" in last
    reproduced = circular == len(FIRST)
    print("reproduced: nanotron does not import, from any module of the cycle" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
