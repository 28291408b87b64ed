# Sourced by the other scripts: makes (once) and activates the project's virtual environment.
# Needs only python3. Torch: a GPU machine gets the CUDA build that pyproject's range selects; a
# machine without a GPU first gets torch==2.13.0 (a CPU build where one is on disk, as on our CI
# runners). CONFORMANCE_TORCH overrides that first step ("skip" leaves torch to pyproject).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CONFORMANCE_VENV:-$ROOT/.venv}"
cd "$ROOT"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
stamp="$VENV/.conformance-installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  pip_quiet=(--quiet --disable-pip-version-check)
  if ! python -c "import torch" 2>/dev/null; then
    torch_spec="${CONFORMANCE_TORCH:-}"
    if [ -z "$torch_spec" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
      torch_spec="torch==2.13.0"
    fi
    if [ -n "$torch_spec" ] && [ "$torch_spec" != "skip" ]; then
      pip install "${pip_quiet[@]}" "$torch_spec"
    fi
  fi
  pip install "${pip_quiet[@]}" -e ".[plots]" 2>/dev/null || pip install "${pip_quiet[@]}" -e .
  touch "$stamp"
fi
export PYTHONUNBUFFERED=1
