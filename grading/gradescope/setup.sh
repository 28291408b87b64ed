#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu 22.04 by default),
# in the folder the zip was unpacked to (/autograder/source). It installs everything grading needs,
# so that nothing is downloaded while a submission is graded:
#   1. a Python the suite supports (3.11 or newer): Ubuntu 22.04's python3 is 3.10, and its universe
#      component has python3.11 and python3.11-venv;
#   2. a virtual environment outside any private home (contained ranks run as other users with no
#      capability, so the Python they run must be world-readable: /root is not), default
#      /opt/conformance-venv;
#   3. torch's CPU build from the CPU wheel index (the public index's torch for Linux is the CUDA
#      build, gigabytes the platform's machines cannot use), at the version of requirements.lock;
#   4. every other package at requirements.lock's version, so the examples Hypothesis draws here are
#      those a student draws locally under the same lock;
#   5. the course's own packages (autograder.json's "requirements", e.g. a CS336 handout's einops and
#      triton), with the lock as constraints: none of them may change torch or anything else it pins;
#   6. the suite installed into the venv as its package, compiled to bytecode, made readable by every
#      user, then checked by importing it.
# Overrides (for the emulation in tests/ and for other platforms): CONFORMANCE_AUTOGRADER_VENV,
# CONFORMANCE_PYTHON (an interpreter to use), CONFORMANCE_TORCH_INDEX ("" uses pip's own index).
set -euo pipefail
SOURCE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${CONFORMANCE_AUTOGRADER_VENV:-/opt/conformance-venv}"
TORCH_INDEX="${CONFORMANCE_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
cd "$SOURCE"

supported() { "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
PYTHON="${CONFORMANCE_PYTHON:-}"
if [ -z "$PYTHON" ]; then
  for candidate in /usr/bin/python3.13 /usr/bin/python3.12 /usr/bin/python3.11 /usr/bin/python3; do
    if supported "$candidate"; then PYTHON="$candidate"; break; fi
  done
fi
if [ -z "$PYTHON" ]; then
  echo "[setup] installing python3.11 (the image's python3 is $(python3 --version 2>&1 || echo missing))"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends python3.11 python3.11-venv
  PYTHON=/usr/bin/python3.11
fi
supported "$PYTHON" || { echo "[setup] $PYTHON is not Python 3.11 or newer with venv" >&2; exit 1; }
echo "[setup] $("$PYTHON" --version) at $PYTHON; virtual environment $VENV"

"$PYTHON" -m venv "$VENV"
pip_install=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input)
torch_pin="$(grep -E '^torch==' requirements.lock)"
if [ -n "$TORCH_INDEX" ]; then
  "${pip_install[@]}" --index-url "$TORCH_INDEX" "$torch_pin"
else
  "${pip_install[@]}" "$torch_pin"
fi
"${pip_install[@]}" -r requirements.lock
course="$(mktemp)"
"$VENV/bin/python" -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1])).get("requirements", [])))' \
  autograder.json > "$course"
if [ -s "$course" ] && grep -q . "$course"; then
  echo "[setup] the course's packages: $(grep . "$course" | tr '\n' ' ')"
  torch_before="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  "${pip_install[@]}" -r "$course" -c requirements.lock
  torch_after="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  if [ "$torch_before" != "$torch_after" ]; then
    echo "[setup] the course's packages changed torch from $torch_before to $torch_after" >&2
    exit 1
  fi
fi
rm -f "$course"

# 6. the suite itself, from this folder, as a package of the venv (parallelism_conformance): the
#    venv's setuptools builds it with no download where it has one new enough, else pip fetches one
"${pip_install[@]}" --no-deps --force-reinstall --no-build-isolation "$SOURCE" 2>/dev/null \
  || "${pip_install[@]}" --no-deps --force-reinstall "$SOURCE"  # this zip's copy, also over an earlier one
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/parallelism_conformance" > /dev/null
chmod -R a+rX "$SOURCE" "$VENV"
# every folder above the suite and the environment must let other users through (contained ranks)
for path in "$SOURCE" "$VENV"; do
  while [ "$path" != "/" ]; do chmod o+x "$path"; path="$(dirname "$path")"; done
done
chmod 755 "$SOURCE/run_autograder"
cd /  # the check imports the installed package, not this folder's copy
"$VENV/bin/python" -c "import torch, hypothesis, pytest, parallelism_conformance.harness.driver.gradescope.run; \
print('[setup] ready: torch', torch.__version__, 'CUDA build' if torch.version.cuda else 'CPU build', \
'hypothesis', hypothesis.__version__, 'pytest', pytest.__version__)"
