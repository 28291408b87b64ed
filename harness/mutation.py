"""The suite proves its own power: ``python -m harness.mutation`` runs the conformance suite
against every known-good implementation (each must pass) and every known-buggy one under mutants/
(each must fail), then prints the kill rate and the false-failure count. Exit status 0 only when
every mutant is killed and no known-good implementation fails.

A mutant is never imported here: its docstring is read with ast. Its first line states the bug; a
'targets:' line gives the pytest -k expression that selects the tests expected to catch it.
"""
from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from harness.capabilities import CAPABILITIES, conformance_file_of_mutants

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
MUTANT_RANK_TIMEOUT_S = 20


@dataclass(frozen=True)
class Mutant:
    path: Path
    bug: str
    targets: str
    test_file: str

    @classmethod
    def read(cls, path: Path) -> "Mutant":
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines = doc.splitlines()
        targets = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("targets:")), "")
        if not lines or not targets:
            raise ValueError(f"{path}: the docstring must state the bug in its first line and have a 'targets:' line")
        return cls(path, lines[0], targets, conformance_file_of_mutants(path.parent.name))


def known_good() -> list[tuple[str, list[str]]]:
    """(implementation, pytest arguments) that must pass: the bundled implementations (the naive
    DP variant too), torch.distributed's collectives, and torch's own everything (DDP, DTensor,
    pipelining) through adapters/torch_native.py."""
    runs = [("impls", ["conformance"]),
            ("torch.distributed", ["conformance/test_collectives.py", "conformance/test_audit.py",
                                   "--capability", "collectives,audit"]),
            ("impls.naive_dp", ["conformance/test_data_parallel.py"]),
            # torch's context parallelism runs on CUDA SDPA kernels only: the adapter does not claim it
            ("adapters.torch_native", ["conformance", "--capability", ",".join(
                sorted(c.name for c in CAPABILITIES if c.name != "context_parallel"))])]
    return runs


def mutants() -> list[Mutant]:
    """Every mutant; a folder no capability of harness/capabilities.py claims is an error, never skipped."""
    return [Mutant.read(p) for p in sorted(MUTANTS.glob("*/*.py")) if p.name != "__init__.py"]


def pytest(impl: str, args: list[str], profile: str) -> tuple[int, str, float]:
    command = [sys.executable, "-m", "pytest", *args, "--impl", impl, f"--hypothesis-profile={profile}", "-q",
               "-p", "no:cacheprovider"]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def failing_line(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("E  ") and line.strip() != "E":
            return line[1:].strip()[:140]
    return "(no assertion line)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="ci", help="Hypothesis profile of the known-good runs (default: ci)")
    parser.add_argument("--mutant-profile", default="mutation",
                        help="Hypothesis profile of the mutant runs (default: mutation, which does not shrink)")
    parser.add_argument("--mutants-only", action="store_true", help="skip the known-good runs")
    parser.add_argument("--jobs", type=int, default=2, help="pytest runs at a time (default 2)")
    options = parser.parse_args(argv)

    # Two runs at a time: each spends seconds importing torch on one core before its ranks start.
    false_failures = []
    goods = [] if options.mutants_only else known_good()
    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        for (impl, args), (code, output, seconds) in zip(goods, pool.map(lambda run: pytest(*run, options.profile), goods)):
            print(f"\n=== known good: {impl} ({' '.join(args)}), {seconds:.0f} s\n{output.rstrip()}", flush=True)
            if code != 0:
                false_failures.append(f"{impl} (exit code {code})")

    print("\n=== known-buggy implementations (each must fail)")
    killed, survived = [], []

    def run_mutant(mutant: Mutant):  # a mutant that hangs is killed by its first deadline: 20 s is plenty here
        return pytest(str(mutant.path.relative_to(ROOT)), [mutant.test_file, "-x", "-k", mutant.targets,
                                                           "--rank-timeout", str(MUTANT_RANK_TIMEOUT_S)],
                      options.mutant_profile)

    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        every = mutants()
        for mutant, (code, output, seconds) in zip(every, pool.map(run_mutant, every)):
            name = f"{mutant.path.parent.name}/{mutant.path.stem}"
            if code == 1:
                killed.append(name)
                print(f"killed   {name:<50} {seconds:5.1f} s  {mutant.bug}\n         caught by: {failing_line(output)}",
                      flush=True)
            else:
                why = {0: "every selected test passed", 5: "its targets select no test"}.get(code, f"pytest exit code {code}")
                survived.append(name)
                print(f"SURVIVED {name:<50} {seconds:5.1f} s  {mutant.bug}\n         ({why})", flush=True)

    total = len(killed) + len(survived)
    rate = 100.0 * len(killed) / total if total else 0.0
    print(f"\n=== kill rate: {len(killed)}/{total} mutants killed ({rate:.0f}%); "
          f"false failures: {len(false_failures)}/{len(goods)} known-good implementations"
          + (f" ({', '.join(false_failures)})" if false_failures else ""))
    return 0 if total and not survived and not false_failures else 1


if __name__ == "__main__":
    sys.exit(main())
