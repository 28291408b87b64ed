"""The suite proves its own power: ``python -m harness.driver.mutation`` runs the conformance suite
against every known-good implementation (each must pass) and every known-buggy one under mutants/
(each must fail), then prints the kill rate and the false-failure count. Exit status 0 only when
every mutant is killed and no known-good implementation fails.

A mutant is never imported here: its docstring is read with ast. Its first line states the bug; a
'targets:' line gives the pytest -k expression that selects the tests expected to catch it.

The suite's own mutants are necessary, not sufficient: outsiders/ holds implementations written
from CONTRACT.md and the starter alone, by authors who never read the tests, each with a
'verdict: pass' (a correct one: it must pass) or 'verdict: fail' (one realistic bug: the suite must
catch it) and the 'capability:' it claims. They run against that capability's whole conformance
file and the communication audit of what they claim, and the kill rate on them is reported apart;
a bug that gets through fails the run (the suite then gets the check that catches it). 'audit:' on
a correct one says why its communication exceeds the audit's
bounds by its author's design (e.g. an all-reduce that sends whole tensors): its values must pass
and its audit must fail.
"""
from __future__ import annotations

import argparse
import ast
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from harness.driver.capabilities import BY_NAME, CAPABILITIES, GROUPS, conformance_file_of_mutants
from harness.driver.warm_pytest import WarmPytest

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = ROOT / "mutants"
OUTSIDERS = ROOT / "outsiders"
CS336_FIXTURE = ROOT / "tests" / "fixtures" / "cs336_submission"  # a CS336 submission of the project's own
MUTANT_RANK_TIMEOUT_S = 10  # a mutant's tasks take well under a second; a hang waits this out idle


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


@dataclass(frozen=True)
class Outsider:
    path: Path
    summary: str  # the docstring's first line: the bug, or "Correct: ..."
    verdict: str  # "pass" or "fail": what the suite must say
    capability: str  # what it claims (a capability or a group of harness/driver/capabilities.py)
    audit: str  # for a correct one whose communication exceeds the audit's bounds: why ('' otherwise)

    @classmethod
    def read(cls, path: Path) -> "Outsider":
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines = doc.splitlines()
        fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:]) if k.strip() in
                  ("verdict", "capability", "audit")}
        verdict, capability = fields.get("verdict", ""), fields.get("capability", "")
        if not lines or verdict not in ("pass", "fail") or not (capability in BY_NAME or capability in GROUPS):
            raise ValueError(f"{path}: the docstring needs a first line, 'verdict: pass|fail' and 'capability: NAME' "
                             f"(a capability or group of harness/driver/capabilities.py), got verdict={verdict!r}, "
                             f"capability={capability!r}")
        return cls(path, lines[0], verdict, capability, fields.get("audit", ""))

    def pytest_args(self) -> list[str]:
        """Its capability's conformance file and the communication audit of what it claims (the
        audit of a capability runs only when that capability is claimed)."""
        spec = BY_NAME.get(self.capability)
        test_file = spec.conformance if spec else next(c.conformance for c in CAPABILITIES if c.group == self.capability)
        if self.audit:  # its values alone; audit_args() holds its audit, which must fail
            return [test_file, "--capability", self.capability]
        args = [test_file, "conformance/test_audit.py", "--capability", f"{self.capability},audit"]
        return args if self.verdict == "pass" else [*args, "-x", "--rank-timeout", str(MUTANT_RANK_TIMEOUT_S)]


    def audit_args(self) -> list[str]:
        return ["conformance/test_audit.py", "--capability", f"{self.capability},audit", "-x", "--rank-timeout",
                str(MUTANT_RANK_TIMEOUT_S)]


def outsiders() -> list[Outsider]:
    return [Outsider.read(p) for p in sorted(OUTSIDERS.glob("*/*.py")) if p.name != "__init__.py"]


def known_good() -> list[tuple[str, list[str], dict[str, str]]]:
    """(implementation, pytest arguments, environment) that must pass: the bundled implementations
    (the naive DP variant too), torch.distributed's collectives, torch's own everything (DDP,
    DTensor, pipelining) through adapters/torch_native.py, and a CS336 assignment-2 submission
    (the project's own, tests/fixtures/cs336_submission) through adapters/cs336.py."""
    runs = [("impls", ["conformance"]),
            ("torch.distributed", ["conformance/test_collectives.py", "conformance/test_audit.py",
                                   "--capability", "collectives,audit"]),
            # the naive variant of the bundled DP (bucket_size_mb ignored): a second opinion, fewer examples
            ("impls.naive_dp", ["conformance/test_data_parallel.py", "--hypothesis-profile=brief"]),
            # every capability; context parallelism is skipped with torch's reason (not adapted). A second
            # opinion on the same tests as the first run, so fewer examples: under ci it was the longest
            # run (13 min of a 37 min CI on a slow day), under brief about half
            ("adapters.torch_native", ["conformance", "--hypothesis-profile=brief"])]
    runs = [(impl, args, {}) for impl, args in runs]
    runs.append(("adapters.cs336", ["conformance/test_data_parallel.py", "conformance/test_sharded_optimizer.py",
                                    "conformance/test_audit.py", "--capability", "data_parallel,sharded_optimizer,audit",
                                    "--hypothesis-profile=brief"],
                 {"CS336_SUBMISSION": str(CS336_FIXTURE)}))
    # the newer handout's names (get_ddp for every bucket size) under the handout's scope
    runs.append(("adapters.cs336", ["conformance/test_data_parallel.py", "--capability", "data_parallel", "--scope",
                                    "cs336", "-k", "mean_over_ranks or start_from", "--hypothesis-profile=brief"],
                 {"CS336_SUBMISSION": str(CS336_FIXTURE / "tests" / "adapters_newer.py")}))
    return runs


def mutants() -> list[Mutant]:
    """Every mutant; a folder no capability of harness/driver/capabilities.py claims is an error, never skipped."""
    return [Mutant.read(p) for p in sorted(MUTANTS.glob("*/*.py")) if p.name != "__init__.py"]


def pytest(runner: WarmPytest, impl: str, args: list[str], profile: str,
           env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """One pytest run of its own (forked from runner's template: see harness/driver/warm_pytest.py)."""
    chosen = any(a.startswith("--hypothesis-profile") for a in args)  # a run's own profile wins
    return runner.run([*args, "--impl", impl, *([] if chosen else [f"--hypothesis-profile={profile}"]), "-q", "-p",
                       "no:cacheprovider"], cwd=str(ROOT), env=env)


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
    parser.add_argument("--outsider-profile", default="brief",
                        help="Hypothesis profile of the correct implementations under outsiders/ (default: brief, "
                             "10 derandomized examples: each runs a whole conformance file)")
    parser.add_argument("--mutants-only", action="store_true", help="skip the known-good runs")
    parser.add_argument("--outsiders-only", action="store_true",
                        help="only the implementations under outsiders/ (no known-good runs, no mutants)")
    parser.add_argument("--jobs", type=int, default=2, help="pytest runs at a time (default 2)")
    options = parser.parse_args(argv)
    with WarmPytest() as runner:
        return _run_all(options, runner)


def _run_all(options, runner: WarmPytest) -> int:
    false_failures = []
    goods = [] if options.mutants_only or options.outsiders_only else known_good()
    def run_mutant(mutant: Mutant):  # a mutant that hangs is killed by its first deadline
        return pytest(runner, str(mutant.path.relative_to(ROOT)), [mutant.test_file, "-x", "-k", mutant.targets,
                                                           "--rank-timeout", str(MUTANT_RANK_TIMEOUT_S)],
                      options.mutant_profile)

    def run_outsider(outsider: Outsider):
        impl = str(outsider.path.relative_to(ROOT))
        profile = options.outsider_profile if outsider.verdict == "pass" else options.mutant_profile
        code, output, seconds = pytest(runner, impl, outsider.pytest_args(), profile)
        if outsider.audit and code == 0:  # right values; the audit must then find what its author chose
            audit_code, audit_output, audit_seconds = pytest(runner, impl, outsider.audit_args(),
                                                             options.mutant_profile)
            if audit_code != 1:
                return audit_code or 2, f"its audit was expected to fail ({outsider.audit}), exit code {audit_code}\n" \
                    + audit_output, seconds + audit_seconds
            return code, output, seconds + audit_seconds
        return code, output, seconds

    # One pool for every run, the longest kinds first (known-good runs, then the whole-file runs of
    # outsiders/, then the mutants' targeted runs), so that no phase waits for its last straggler
    # while cores idle; results are printed section by section, in order.
    every_mutant = [] if options.outsiders_only else mutants()
    every_outsider = outsiders()
    pool = ThreadPoolExecutor(max_workers=options.jobs)
    good_runs = [pool.submit(pytest, runner, impl, args, options.profile, env) for impl, args, env in goods]
    outsider_runs = [pool.submit(run_outsider, outsider) for outsider in every_outsider]
    mutant_runs = [pool.submit(run_mutant, mutant) for mutant in every_mutant]
    for (impl, args, env), run in zip(goods, good_runs):
        code, output, seconds = run.result()
        print(f"\n=== known good: {impl} ({' '.join(args)}), {seconds:.0f} s\n{output.rstrip()}", flush=True)
        if code != 0:
            false_failures.append(f"{impl} (exit code {code})")

    print("\n=== known-buggy implementations (each must fail)")
    killed, survived = [], []
    for mutant, run in zip(every_mutant, mutant_runs):
        code, output, seconds = run.result()
        name = f"{mutant.path.parent.name}/{mutant.path.stem}"
        if code == 1:
            killed.append(name)
            print(f"killed   {name:<50} {seconds:5.1f} s  {mutant.bug}\n         caught by: {failing_line(output)}",
                  flush=True)
        else:
            why = {0: "every selected test passed", 5: "its targets select no test"}.get(code, f"pytest exit code {code}")
            survived.append(name)
            print(f"SURVIVED {name:<50} {seconds:5.1f} s  {mutant.bug}\n         ({why})", flush=True)

    print("\n=== implementations written from the contract alone (outsiders/): correct ones must pass, "
          "buggy ones must fail")
    caught, missed, outside_false = [], [], []

    for outsider, run in zip(every_outsider, outsider_runs):
        code, output, seconds = run.result()
        name = f"{outsider.path.parent.name}/{outsider.path.stem}"
        if outsider.verdict == "pass":
            ok = code == 0
            if not ok:
                outside_false.append(name)
            print(f"{'passes  ' if ok else 'FAILS   '} {name:<50} {seconds:5.1f} s  {outsider.summary}"
                  + (f"\n         (values pass; the audit fails it, as its author chose: {outsider.audit})"
                     if ok and outsider.audit else "")
                  + ("" if ok else f"\n         (pytest exit code {code}: {failing_line(output)})"), flush=True)
            continue
        if code == 1:
            caught.append(name)
            print(f"caught   {name:<50} {seconds:5.1f} s  {outsider.summary}\n         by: {failing_line(output)}",
                  flush=True)
        else:
            missed.append(name)
            why = {0: "every test passed", 5: "no test selected"}.get(code, f"pytest exit code {code}")
            print(f"MISSED   {name:<50} {seconds:5.1f} s  {outsider.summary}\n         ({why})", flush=True)

    total = len(killed) + len(survived)
    rate = 100.0 * len(killed) / total if total else 0.0
    buggy = len(caught) + len(missed)
    correct = len(every_outsider) - buggy
    pool.shutdown()
    print(f"\n=== kill rate: {len(killed)}/{total} mutants killed ({rate:.0f}%); "
          f"false failures: {len(false_failures)}/{len(goods)} known-good implementations"
          + (f" ({', '.join(false_failures)})" if false_failures else ""))
    print(f"=== written from the contract alone: {len(caught)}/{buggy} buggy ones caught"
          + (f" (missed: {', '.join(missed)})" if missed else "")
          + f"; false failures: {len(outside_false)}/{correct} correct ones"
          + (f" ({', '.join(outside_false)})" if outside_false else ""))
    ran = total or options.outsiders_only
    return 0 if ran and not survived and not false_failures and not missed and not outside_false else 1


if __name__ == "__main__":
    sys.exit(main())
