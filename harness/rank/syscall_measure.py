"""Measures the system calls a contained rank makes once the implementation may load: the allow
list's source (harness/rank/syscall_allowlist.py, ALLOWED).

    python -m parallelism_conformance.harness.rank.syscall_measure [--seed harness|listed] [-- PYTEST ARGS]

runs, with the allow list's helper letting every call through and writing down its name
(harness/rank/refusal_reporter.py, measuring), first ORDINARY below in a process filtered as a rank
is (what honest Python in an implementation does that the suite's own code may not: a thread, a
file, a clock, random bytes, torch's kernels), then, when given, a contained pytest run with PYTEST
ARGS (``--contain-ranks yes`` is added; root only). It prints the names seen and ALLOWED's text with
them. ``--seed harness`` (the default) starts from HARNESS alone, so that every call is seen;
``listed`` from ALLOWED too, to find only what is new.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from parallelism_conformance.harness.rank import syscall_allowlist
from parallelism_conformance.harness.rank.refusal_reporter import MEASURE_ENV

ORDINARY = r"""
import ctypes, io, json, os, random, tempfile, threading, time
import torch
from parallelism_conformance.harness.rank import syscall_allowlist
assert ctypes.CDLL(None).prctl(38, 1, 0, 0, 0) == 0  # no_new_privs, as containment.enter leaves it
reporter = syscall_allowlist.install()  # kept: its socket closed, the helper leaves
worker = threading.Thread(target=lambda: sum(range(1000)))
worker.start(); worker.join()
folder = tempfile.mkdtemp()
path = os.path.join(folder, "notes.json")
with open(path, "w") as out:
    json.dump({"x": random.random()}, out)
with open(path) as back:
    json.load(back)
os.listdir(folder); os.stat(path); os.remove(path); os.rmdir(folder)
os.urandom(16); time.time(); time.monotonic(); time.sleep(0.001); os.getcwd(); os.cpu_count()
print("ordinary", flush=True)
a = torch.randn(256, 256); (a @ a).sum().item(); torch.save(a, io.BytesIO())
torch.randn(4, requires_grad=True).pow(2).sum().backward()
"""


def main(argv: list[str]) -> int:
    seed = "harness"
    if argv[:1] == ["--seed"]:
        seed, argv = argv[1], argv[2:]
    pytest_args = argv[1:] if argv[:1] == ["--"] else argv
    folder = Path(tempfile.mkdtemp(prefix="syscall-measure-", dir=os.getcwd()))  # not a swept place (/tmp is)
    os.chmod(folder, 0o1777)
    env = dict(os.environ, **{MEASURE_ENV: str(folder), syscall_allowlist.SEED_ENV: seed})
    done = subprocess.run([sys.executable, "-c", ORDINARY], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return 1
    if pytest_args:
        run = subprocess.run([sys.executable, "-m", "pytest", *pytest_args, "--contain-ranks", "yes"], env=env, capture_output=True, text=True)
        print(run.stdout[-1500:])
    seen = set()
    for record in folder.glob("*.calls"):
        seen |= set(record.read_text().split())
        record.unlink()
    folder.rmdir()
    new = sorted(seen - set(syscall_allowlist.ALLOWED) - set(syscall_allowlist.HARNESS))
    print(f"seen: {len(seen)} calls; not yet in ALLOWED: {' '.join(new) or 'none'}")
    listed = sorted((set(syscall_allowlist.ALLOWED) | seen) - set(syscall_allowlist.HARNESS))
    print("ALLOWED = (\n" + "".join(f'    "{name}",\n' for name in listed) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
