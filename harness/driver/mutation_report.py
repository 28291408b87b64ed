"""What the mutation runner prints and decides per run (harness/driver/mutation.py): the known-good
runs' false failures, each mutant's kill (or why it is not one: a deadline alone, a race not named,
a survival) and each outsider's verdict. With --seeds K a buggy implementation runs at K seeds and is
caught only when every seed catches it: a kill at some seeds only is WEAK (issue 59), the seeds that
missed printed so that the examples that catch it can be added to the tests."""

from __future__ import annotations

from pathlib import Path

from parallelism_conformance.harness.driver.mutation_catalog import HANG, RACE, RACE_EVIDENCE

DEADLINE = "no result within the"  # how a deadline's failure reads (harness/driver/world.py, World._fail)


def first_failure(output: str) -> list[str]:
    """The message of the first failure pytest printed: its first block of "E" lines."""
    block: list[str] = []
    for line in output.splitlines():
        if line.startswith("E  ") or (block and line == "E"):
            block.append(line[1:].strip())
        elif block:
            break
    return block


def failing_line(output: str) -> str:
    return next((line[:140] for line in first_failure(output) if line), "(no assertion line)")


def only_a_deadline(output: str) -> bool:
    """The first failure is a task's deadline, which load alone can cause (a deadlock report is not)."""
    return any(DEADLINE in line for line in first_failure(output))


def _name(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def listed(what: str, names: list[str]) -> str:
    return f"; {len(names)} {what}: {', '.join(names)}" if names else ""


def report_known_good(goods, results) -> list[str]:
    false_failures = []
    for (impl, args, _env), (code, output, seconds) in zip(goods, results):
        print(f"\n=== known good: {impl} ({' '.join(args)}), {seconds:.0f} s\n{output.rstrip()}", flush=True)
        if code != 0:
            false_failures.append(f"{impl} (exit code {code})")
    return false_failures


def _mutant_outcome(mutant, code: int, output: str) -> tuple[str, str]:
    """One run of a mutant: ("killed" | "deadline" | "unnamed" | "unloaded" | "survived", what to print)."""
    if code == 1 and only_a_deadline(output) and not mutant.hang:
        return "deadline", (
            f"killed only by a deadline: the runner cannot tell this from load ({failing_line(output)}); "
            f"if its bug is a hang, its docstring says '{HANG}'"
        )
    if code == 1 and "ImplementationUnloadable" in failing_line(output):
        # a mutant that does not load fails every test and kills nothing: its bug was never run
        return "unloaded", f"does not load, so its bug was never run (not a kill): {failing_line(output)}"
    if code == 1 and mutant.race and RACE_EVIDENCE not in output:
        return "unnamed", f"failed, but not with --perturb-timing naming the call ('{RACE}' in its docstring): {failing_line(output)}"
    if code == 1:
        return "killed", f"caught by: {failing_line(output)}"
    return "survived", "(" + {0: "every selected test passed", 5: "its targets select no test"}.get(code, f"pytest exit code {code}") + ")"


def _seeds_of(jobs) -> str:
    return ", ".join(job.key.rsplit("(seed ", 1)[1].rstrip(")") for job in jobs if "(seed " in job.key)


def report_mutants(every_mutant, jobs, result) -> tuple[list[str], list[str], list[str]]:
    """``jobs``: per mutant, its runs (one per seed). Killed only when every run kills it."""
    print("\n=== known-buggy implementations (each must fail)")
    killed, survived, deadline_only = [], [], []
    label = {"killed": "killed  ", "deadline": "DEADLINE", "unnamed": "UNNAMED ", "unloaded": "UNLOADED", "survived": "SURVIVED"}
    for mutant, runs in zip(every_mutant, jobs):
        outcomes = [(job, *result(job)) for job in runs]
        name = _name(mutant.path)
        seconds = sum(taken for _, _, _, taken in outcomes)
        judged = [(job, *_mutant_outcome(mutant, code, output)) for job, code, output, _ in outcomes]
        kinds = [kind for _, kind, _ in judged]
        worst = next((k for k in ("survived", "unloaded", "unnamed", "deadline") if k in kinds), "killed")
        head = f"{name:<50} {seconds:5.1f} s  {mutant.bug}"
        if len(runs) > 1 and worst != "killed" and "killed" in kinds:  # caught at some seeds only: a lucky draw
            missed = [job for job, kind, _ in judged if kind != "killed"]
            print(
                f"WEAK     {head}\n         killed at {kinds.count('killed')}/{len(runs)} seeds; not at {_seeds_of(missed)}: "
                f"{next(text for _, kind, text in judged if kind != 'killed')}",
                flush=True,
            )
            survived.append(f"{name} ({kinds.count('killed')}/{len(runs)} seeds)")
            continue
        text = next(text for _, kind, text in judged if kind == worst)
        seeds = f" (at {len(runs)}/{len(runs)} seeds)" if len(runs) > 1 and worst == "killed" else ""
        print(f"{label[worst]} {head}\n         {text}{seeds}", flush=True)
        {"killed": killed, "deadline": deadline_only}.get(worst, survived).append(name)
    return killed, survived, deadline_only


def report_outsiders(every_outsider, jobs, result) -> tuple[list[str], list[str], list[str]]:
    """``jobs``: per outsider, its runs (a buggy one's one per seed). Caught only when every run catches it."""
    print("\n=== implementations written from the contract alone (outsiders/): correct ones must pass, buggy ones must fail")
    caught, missed, outside_false = [], [], []
    for outsider, runs in zip(every_outsider, jobs):
        outcomes = [(job, *result(job)) for job in runs]
        name = outsider.name
        seconds = sum(taken for _, _, _, taken in outcomes)
        head = f"{name:<50} {seconds:5.1f} s  {outsider.summary}"
        if outsider.verdict == "pass":
            _, code, output, _ = outcomes[0]
            ok = code == 0
            if not ok:
                outside_false.append(name)
            print(
                f"{'passes  ' if ok else 'FAILS   '} {head}"
                + (f"\n         (values pass; the audit fails it, as its author chose: {outsider.audit})" if ok and outsider.audit else "")
                + ("" if ok else f"\n         (pytest exit code {code}: {failing_line(output)})"),
                flush=True,
            )
            continue
        escaped = []
        for job, code, output, _ in outcomes:
            if code == 1 and only_a_deadline(output) and not outsider.hang:
                escaped.append(
                    (
                        job,
                        f"caught only by a deadline: the runner cannot tell this from load ({failing_line(output)}); "
                        f"if its bug is a hang, its docstring says '{HANG}'",
                    )
                )
            elif code == 1 and "ImplementationUnloadable" in failing_line(output):
                escaped.append((job, f"does not load, so its bug was never run (not a catch): {failing_line(output)}"))
            elif code != 1:
                escaped.append((job, "(" + {0: "every test passed", 5: "no test selected"}.get(code, f"pytest exit code {code}") + ")"))
        if not escaped:
            caught.append(name)
            seeds = f" (at {len(runs)}/{len(runs)} seeds)" if len(runs) > 1 else ""
            print(f"caught   {head}\n         by: {failing_line(outcomes[0][2])}{seeds}", flush=True)
        elif len(runs) > 1 and len(escaped) < len(runs):
            missed.append(f"{name} ({len(runs) - len(escaped)}/{len(runs)} seeds)")
            print(
                f"WEAK     {head}\n         caught at {len(runs) - len(escaped)}/{len(runs)} seeds; not at "
                f"{_seeds_of([job for job, _ in escaped])}: {escaped[0][1]}",
                flush=True,
            )
        else:
            missed.append(name)
            print(f"{'DEADLINE' if 'deadline' in escaped[0][1] else 'MISSED  '} {head}\n         {escaped[0][1]}", flush=True)
    return caught, missed, outside_false
