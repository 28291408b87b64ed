"""The suite proves its own power: ``python -m parallelism_conformance.harness.driver.mutation`` runs the conformance suite
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
a bug that gets through fails the run (the suite then gets the check that catches it). Each buggy
one is kept as a diff against its author's correct file (outsiders/<capability>/bugs/<name>.diff,
harness/driver/outsider_patches.py), written out under its own name into a temporary folder for the
runner's whole run and named by it in the report. 'audit:' on a correct one says why its
communication exceeds the audit's bounds by its author's design (e.g. an all-reduce that sends
whole tensors): its values must pass and its audit must fail.

Every known-good run and every correct outsider runs under --perturb-timing on (calls complete
late, outputs poisoned until waited for: harness/rank/perturbation.py): a false failure there is a
bug of the perturbation. A mutant whose docstring has a 'race:' line (its bug is a race: a result
read before its wait, a buffer reused before its send left) runs under --perturb-timing on, and
counts as killed only when its failure names the call ("a race, found by --perturb-timing", under
its every mode: a read before its wait then always holds poison, never gloo's garbled values):
values the scheduler happened to garble are not evidence, since they do not fail on every run.

A kill must be evidence, not load: a buggy implementation whose first failure is a task's deadline
("no result within the N s deadline") counts as a failure of the runner, since a deadline missed on
a busy machine reads the same, unless its docstring has the line 'bug: hang' (its bug is that ranks
wait forever). A deadlock report ("deadlock: every rank is waiting ...") is evidence: nothing moved.

Time: every run stops at its first failure (-x) and runs only what its targets select; the runs go
to --jobs workers longest first, by the seconds each took in the last run (DURATIONS_FILE) or, for a
run never timed, a static estimate of its kind, so that no worker idles at the end waiting for one
long straggler. The last lines say where the time went. Per commit (scripts/test) the runner runs
every known-good run and every correct outsider on fewer examples (--profile second_opinion,
--second-opinion-profile smoke, --outsider-profile smoke) and one in four of each capability's
mutants and buggy outsiders (--rotate 4, chosen by the commit's hash: mutation_catalog.rotation);
nightly (scripts/test --full) every one at full depth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from parallelism_conformance.harness.driver.mutation_catalog import (
    MUTANT_RANK_TIMEOUT_S,
    ROOT,
    Mutant,
    Outsider,
    known_good,
    mutants,
    outsiders,
    rotated,
)
from parallelism_conformance.harness.driver.mutation_report import (  # noqa: F401 - failing_line, only_a_deadline: the runner's rules
    failing_line,
    listed,
    only_a_deadline,
    report_known_good,
    report_mutants,
    report_outsiders,
)
from parallelism_conformance.harness.driver.warm_pytest import WarmPytest
from parallelism_conformance.harness.rank.preload import PRELOAD

PERTURBED = ("--perturb-timing", "on")  # every known-good run: a false failure under it is the perturbation's bug
DURATIONS_FILE = ROOT / ".mutation-durations.json"  # each run's seconds in the last run (git ignores it)
# A run never timed is placed by its kind: the median seconds of each kind, measured on the 2-core
# machine with tests/ beside the runner (known-good runs were 36-279 s: first in any order).
ESTIMATE_S = {"known good": 120.0, "outsider": 20.0, "mutant": 9.0}

# What none of the runner's runs uses, each loaded by every one of its ~290 runs: pytest-benchmark
# and xdist cost 0.25-0.35 s of CPU a run together (measured on a run that selects no test; more
# CPU than the run's wall time, so part of it outside the run's own process).
UNUSED_PLUGINS = ("-p", "no:cacheprovider", "-p", "no:benchmark", "-p", "no:xdist", "-p", "no:xdist.looponfail")


def pytest(runner: WarmPytest, impl: str, args: list[str], profile: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """One pytest run of its own (forked from runner's template: see harness/driver/warm_pytest.py)."""
    chosen = any(a.startswith("--hypothesis-profile") for a in args)  # a run's own profile wins
    return runner.run(
        [*args, "--impl", impl, *([] if chosen else [f"--hypothesis-profile={profile}"]), "-q", *UNUSED_PLUGINS], cwd=str(ROOT), env=env
    )


def second_opinion(args: list[str], profile: str | None) -> list[str]:
    """A known-good run's arguments with its own Hypothesis profile (a second opinion's) replaced by
    ``profile``; unchanged where it names none (it runs under --profile) or ``profile`` is None."""
    if profile is None:
        return args
    return [f"--hypothesis-profile={profile}" if a.startswith("--hypothesis-profile") else a for a in args]


@dataclass(frozen=True)
class Job:
    """One pytest run of the runner, named in the durations file by ``key``."""

    key: str
    kind: str  # a key of ESTIMATE_S
    run: Callable[[], tuple[int, str, float]]


def read_durations(path: Path) -> dict[str, float]:
    """Each run's seconds in the last run, {} where there was none or it cannot be read (a fresh clone)."""
    try:
        durations = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in durations.items() if isinstance(v, (int, float))} if isinstance(durations, dict) else {}


def longest_first(jobs: list[Job], durations: dict[str, float]) -> list[Job]:
    """The order to start them in: the longest first, by the last run's seconds or the kind's estimate
    (the sort is stable: runs of one estimate keep their order)."""
    return sorted(jobs, key=lambda job: -durations.get(job.key, ESTIMATE_S[job.kind]))


def start(jobs: list[Job], durations: dict[str, float], workers: ThreadPoolExecutor) -> dict[str, Future]:
    return {job.key: workers.submit(job.run) for job in longest_first(jobs, durations)}


def write_durations(path: Path, seconds: dict[str, float]) -> None:
    try:
        path.write_text(json.dumps({k: round(v, 1) for k, v in sorted(seconds.items())}, indent=0) + "\n")
    except OSError as error:  # a read-only checkout: the next run falls back to the estimates
        print(f"(the runs' durations were not written to {path}: {error})")


def time_line(jobs: list[Job], seconds: dict[str, float], wall_s: float, workers: int) -> str:
    """Where the time went: per kind, the runs and their seconds, and the wall time of them all."""
    parts = []
    for kind in ESTIMATE_S:
        taken = sorted((seconds[job.key] for job in jobs if job.kind == kind), reverse=True)
        if taken:
            parts.append(f"{kind}: {len(taken)} runs, {sum(taken):.0f} s (longest {taken[0]:.0f} s, median {taken[len(taken) // 2]:.1f} s)")
    busy = sum(seconds.values())
    return (
        f"=== time: {'; '.join(parts)}; {busy:.0f} s of runs in {wall_s:.0f} s wall on {workers} workers "
        f"({busy / max(wall_s, 1e-9) / workers:.0%} busy)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="ci", help="Hypothesis profile of the known-good runs (default: ci)")
    parser.add_argument(
        "--mutant-profile", default="mutation", help="Hypothesis profile of the mutant runs (default: mutation, which does not shrink)"
    )
    # second_opinion (5 examples a test): on the 93 outsider runs alone, 0/28 false failures under it as under
    # brief (10), 156 s instead of 200 s; the buggy ones keep the mutants' profile (under brief 3 of 65 got through)
    parser.add_argument(
        "--outsider-profile",
        default="second_opinion",
        help="Hypothesis profile of the correct implementations under outsiders/ (default: "
        "second_opinion, 5 derandomized examples a test: each runs a whole conformance file)",
    )
    # the test command's tier (scripts/test) names smoke here and second_opinion for --profile: every test of every
    # known-good run still runs, on fewer examples; scripts/test --full leaves both at their defaults
    parser.add_argument(
        "--second-opinion-profile",
        default=None,
        help="Hypothesis profile of the known-good runs that name their own (the second opinions: torch's own "
        "modules, the naive DP, the CS336 submission); by default each keeps its own",
    )
    # the test command's tier: a share of the mutants and of the buggy outsiders per commit, by turns
    parser.add_argument(
        "--rotate",
        type=int,
        default=1,
        metavar="K",
        help="run one in K of each capability's mutants and of its buggy outsiders (at least one of each), "
        "chosen by --rotation-seed; 1 (the default) runs every one",
    )
    parser.add_argument("--rotation-seed", default="0", help="what chooses the rotation's share (the test command passes the commit's hash)")
    # issue 59: a kill that rests on a lucky draw is caught until the next unrelated edit of a test
    parser.add_argument(
        "--seeds",
        type=int,
        default=0,
        metavar="K",
        help="run every mutant and buggy outsider at K random seeds (derandomization off, the seeds printed) and "
        "fail unless each is caught at all K (the nightly tier: 5); 0 (the default): once, derandomized",
    )
    parser.add_argument("--mutants-only", action="store_true", help="skip the known-good runs")
    parser.add_argument(
        "--only",
        default="",
        metavar="FOLDERS",
        help="only the mutants and outsiders of these folders (mutants/<folder>, outsiders/<folder>; comma-separated)",
    )
    parser.add_argument(
        "--outsiders-only", action="store_true", help="only the implementations under outsiders/ (no known-good runs, no mutants)"
    )
    parser.add_argument("--jobs", type=int, default=2, help="pytest runs at a time (default 2)")
    parser.add_argument(
        "--durations-file",
        type=Path,
        default=DURATIONS_FILE,
        help=f"each run's seconds, read to start the longest first and rewritten at the end "
        f"(default {DURATIONS_FILE.name} at the repository's root)",
    )
    options = parser.parse_args(argv)
    # every run's ranks are forked from the template's forkserver: about 2.4 s of CPU less per run
    # the buggy outsiders kept as diffs are written out here, for the whole run
    with WarmPytest(forkserver_preload=list(PRELOAD)) as runner, tempfile.TemporaryDirectory(prefix="outsiders-") as scratch:
        os.chmod(scratch, 0o755)
        return _run_all(options, runner, Path(scratch))


def _name(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def seeds_of(k: int) -> list[int | None]:
    """--seeds K: K random seeds, drawn anew each run (so that K runs over nights reach K new ones),
    or [None]: one derandomized run."""
    return [None] if k < 1 else [int.from_bytes(os.urandom(4), "big") for _ in range(k)]


def at(seed: int | None) -> str:
    return "" if seed is None else f" (seed {seed})"


def seeded(profile: str, seed: int | None) -> list[str]:
    """A buggy run's profile, or its random twin at ``seed`` (profiles.py: "<name>_random")."""
    return [f"--hypothesis-profile={profile}"] if seed is None else [f"--hypothesis-profile={profile}_random", f"--hypothesis-seed={seed}"]


def run_mutant(runner: WarmPytest, mutant: Mutant, profile: str, seed: int | None = None) -> tuple[int, str, float]:
    impl, env = mutant.impl_and_env()
    return pytest(
        runner,
        impl,
        [
            mutant.test_file,
            "-x",
            "-k",
            mutant.targets,
            "--rank-timeout",
            str(MUTANT_RANK_TIMEOUT_S),
            "--perturb-timing",
            "every" if mutant.race else "off",  # every call late: a read before its wait always holds poison
            *seeded(profile, seed),
            *mutant.graded_args(),
        ],
        profile,
        env,
    )


def run_outsider(runner: WarmPytest, outsider: Outsider, impl: str, options, seed: int | None = None) -> tuple[int, str, float]:
    profile = options.outsider_profile if outsider.verdict == "pass" else options.mutant_profile
    perturbed = ["--perturb-timing", "on"] if outsider.verdict == "pass" else seeded(profile, seed)  # a correct one passes under it
    code, output, seconds = pytest(runner, impl, [*outsider.pytest_args(), *perturbed], profile)
    if outsider.audit and code == 0:  # right values; the audit must then find what its author chose
        audit_code, audit_output, audit_seconds = pytest(runner, impl, outsider.audit_args(), options.mutant_profile)
        if audit_code != 1:
            return (
                audit_code or 2,
                f"its audit was expected to fail ({outsider.audit}), exit code {audit_code}\n" + audit_output,
                seconds + audit_seconds,
            )
        return code, output, seconds + audit_seconds
    return code, output, seconds


def _run_all(options, runner: WarmPytest, scratch: Path) -> int:
    goods = [] if options.mutants_only or options.outsiders_only else known_good()
    goods = [(impl, second_opinion(args, options.second_opinion_profile), env) for impl, args, env in goods]
    every_mutant, every_outsider, said = rotated(
        [] if options.outsiders_only else mutants(), outsiders(), options.rotate, options.rotation_seed
    )
    if options.only:  # the folders asked for: a sweep of one capability's buggy implementations
        chosen = set(options.only.split(","))
        every_mutant = [m for m in every_mutant if m.path.parent.name in chosen]
        every_outsider = [o for o in every_outsider if o.name.split("/")[0] in chosen]
    if said:
        print(f"=== {said}", flush=True)
    impls = {o.path: o.impl(scratch) for o in every_outsider}
    good_jobs = [
        Job(
            f"known good: {impl} {' '.join(args)}",
            "known good",
            lambda impl=impl, args=args, env=env: pytest(runner, impl, [*args, *PERTURBED], options.profile, env),
        )
        for impl, args, env in goods
    ]
    seeds = seeds_of(options.seeds)
    if seeds != [None]:
        print(f"=== every mutant and buggy outsider at {len(seeds)} random seeds: {', '.join(map(str, seeds))}", flush=True)
    mutant_jobs = [
        [Job(f"mutant: {_name(m.path)}{at(s)}", "mutant", lambda m=m, s=s: run_mutant(runner, m, options.mutant_profile, s)) for s in seeds]
        for m in every_mutant
    ]
    outsider_jobs = [
        [
            Job(f"outsider: {o.name}{at(s)}", "outsider", lambda o=o, s=s: run_outsider(runner, o, impls[o.path], options, s))
            for s in (seeds if o.verdict == "fail" else [None])  # a correct one runs once, as before
        ]
        for o in every_outsider
    ]
    jobs = [*good_jobs, *(j for each in outsider_jobs for j in each), *(j for each in mutant_jobs for j in each)]
    started = time.monotonic()
    seconds: dict[str, float] = {}
    with ThreadPoolExecutor(max_workers=options.jobs) as workers:
        futures = start(jobs, read_durations(options.durations_file), workers)

        def result(job: Job) -> tuple[int, str, float]:
            code, output, taken = futures[job.key].result()
            seconds[job.key] = taken
            return code, output, taken

        false_failures = report_known_good(goods, [result(job) for job in good_jobs])
        killed, survived, deadline_only = report_mutants(every_mutant, mutant_jobs, result)
        caught, missed, outside_false = report_outsiders(every_outsider, outsider_jobs, result)
    write_durations(options.durations_file, seconds)
    total = len(killed) + len(survived) + len(deadline_only)
    rate = 100.0 * len(killed) / total if total else 0.0
    buggy = len(caught) + len(missed)
    correct = len(every_outsider) - buggy
    print(
        f"\n=== kill rate: {len(killed)}/{total} mutants killed ({rate:.0f}%)"
        + listed("killed only by a deadline", deadline_only)
        + f"; false failures: {len(false_failures)}/{len(goods)} known-good implementations"
        + (f" ({', '.join(false_failures)})" if false_failures else "")
    )
    print(
        f"=== written from the contract alone: {len(caught)}/{buggy} buggy ones caught"
        + (f" (missed: {', '.join(missed)})" if missed else "")
        + f"; false failures: {len(outside_false)}/{correct} correct ones"
        + (f" ({', '.join(outside_false)})" if outside_false else "")
    )
    print(time_line(jobs, seconds, time.monotonic() - started, options.jobs))
    ran = total or options.outsiders_only
    failed = survived or deadline_only or false_failures or missed or outside_false
    return 0 if ran and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
