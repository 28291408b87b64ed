# Sourced by the other scripts: makes (once) and activates the project's virtual environment.
# Needs only python3. Torch, in this order:
#   1. CONFORMANCE_TORCH set: that pip requirement ("torch==2.13.0", a wheel path; "skip" leaves
#      torch to pyproject's range);
#   2. python3 already holds a CUDA torch (NGC containers, most GPU CI images): the venv sees the
#      system site packages and reuses it, instead of downloading another multi-GB build;
#   3. otherwise requirements.lock's torch (torch==2.13.0: a CPU build where one is on disk, as on our CI
#      runners; from the public index, the CUDA build), with every other package at the lock's version.
# Where every dependency is already importable (a GPU image), nothing is installed, so no package
# index is needed (the scripts run from the repository root, so the project itself needs no install).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CONFORMANCE_VENV:-$ROOT/.venv}"
cd "$ROOT"
if [ ! -x "$VENV/bin/python" ]; then
  venv_options=()
  if [ -z "${CONFORMANCE_TORCH:-}" ] && python3 -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null; then
    echo "[bootstrap] reusing python3's CUDA torch $(python3 -c 'import torch; print(torch.__version__)') (venv with system site packages)" >&2
    venv_options=(--system-site-packages)
  fi
  python3 -m venv "${venv_options[@]}" "$VENV"
  if [ "${#venv_options[@]}" -gt 0 ]; then
    # When python3 is itself a virtual environment (/opt/torch/.venv on the GPU image we measured),
    # --system-site-packages shows the base interpreter's packages, not python3's: a .pth file adds
    # python3's own site-packages, where its torch is.
    python3 -c "import site, sys; sys.prefix != sys.base_prefix and print('\n'.join(site.getsitepackages()))" \
      > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/conformance-parent-site.pth"
  fi
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# grading/cs336-requirements.txt: what the project's own CS336 submission (tests/fixtures) imports, as
# the handout's students' code does (einops, einx, jaxtyping, triton), under the lock's constraints
COURSE=grading/cs336-requirements.txt
stamp="$VENV/.conformance-installed-$(cat pyproject.toml requirements.lock "$COURSE" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ] && [ -z "${CONFORMANCE_TORCH:-}" ] \
   && python -c "import torch, numpy, pytest, xdist, hypothesis, pytest_benchmark, einops, einx, jaxtyping, triton" 2>/dev/null; then
  # A GPU image (or a venv made earlier) that already holds every dependency: nothing to download,
  # which also makes the scripts work where no package index is reachable.
  echo "[bootstrap] every dependency is already importable (torch $(python -c 'import torch; print(torch.__version__)')):" \
       "nothing to install" >&2
  touch "$stamp"
fi
if [ ! -f "$stamp" ]; then
  pip_quiet=(--quiet --disable-pip-version-check)
  torch_spec="${CONFORMANCE_TORCH:-}"
  if [ -n "$torch_spec" ] && [ "$torch_spec" != "skip" ]; then
    pip install "${pip_quiet[@]}" "$torch_spec"
  fi
  # Every version from requirements.lock, the one the autograder installs: the examples Hypothesis
  # draws here are then the ones drawn on the grader. A torch already chosen or reused is kept.
  lock="$(mktemp)"
  if [ "$torch_spec" = "skip" ] || python -c "import torch" 2>/dev/null; then
    grep -v '^torch==' requirements.lock > "$lock"
  else
    cp requirements.lock "$lock"
  fi
  if pip install "${pip_quiet[@]}" -r "$lock" && pip install "${pip_quiet[@]}" -r "$COURSE" -c "$lock" \
     && pip install "${pip_quiet[@]}" -e .; then
    pip install "${pip_quiet[@]}" -e ".[plots]" 2>/dev/null || true  # plots are optional
    touch "$stamp"
  elif python -c "import torch, numpy, pytest, xdist, hypothesis, pytest_benchmark" 2>/dev/null; then
    echo "[bootstrap] pip could not install the project (no package index?); every dependency is already" \
         "importable, so the scripts go on from the repository root" >&2
  else
    echo "[bootstrap] pip could not install the project's dependencies, and they are not all importable" >&2
    rm -f "$lock"
    exit 1
  fi
  rm -f "$lock"
fi
export PYTHONUNBUFFERED=1
