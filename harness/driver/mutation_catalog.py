"""What the mutation runner (harness/driver/mutation.py) runs: the known-good implementations, the
mutants under mutants/ and the implementations under outsiders/, each read from its docstring (a
mutant or an outsider is never imported here: ast reads it)."""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from pathlib import Path

from parallelism_conformance.harness.driver.capabilities import BY_NAME, CAPABILITIES, GROUPS, conformance_file_of_mutants
from parallelism_conformance.harness.driver.outsider_patches import materialise, patched

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = ROOT / "mutants"
OUTSIDERS = ROOT / "outsiders"
CS336_FIXTURE = ROOT / "tests" / "fixtures" / "cs336_submission"  # a CS336 submission of the project's own
# a mutant's tasks take well under a second; a deadlock is reported long before this, so only a
# rank that computes forever waits it out
MUTANT_RANK_TIMEOUT_S = 10
HANG = "bug: hang"  # the docstring line of a buggy implementation whose bug is ranks waiting forever
CS336_MUTANT = "graded as: a CS336 submission"  # the docstring line of a mutant that is a tests/adapters.py
# the docstring line of a mutant whose bug is a race: run under --perturb-timing on, and killed only
# by a failure that names the call (harness/driver/perturbation.py), not by values the scheduler garbled
RACE = "race:"
RACE_EVIDENCE = "a race, found by --perturb-timing"
PARALLELIZE = "parallelize"  # the mutants folder whose files are parallelize functions, not implementations
PARALLELIZE_FILE = "conformance/test_parallelize.py"


@dataclass(frozen=True)
class Mutant:
    path: Path
    bug: str
    targets: str
    test_file: str
    hang: bool = False  # its docstring says 'bug: hang': a deadline is a fair kill
    submission: bool = False  # its docstring says 'graded as: a CS336 submission': a tests/adapters.py
    race: bool = False  # its docstring has a 'race:' line: run with --perturb-timing on

    @classmethod
    def read(cls, path: Path) -> Mutant:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines = doc.splitlines()
        targets = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("targets:")), "")
        if not lines or not targets:
            raise ValueError(f"{path}: the docstring must state the bug in its first line and have a 'targets:' line")
        return cls(
            path,
            lines[0],
            targets,
            conformance_file_of_mutants(path.parent.name),
            HANG in lines[1:],
            CS336_MUTANT in lines[1:],
            any(line.startswith(RACE) for line in lines[1:]),
        )

    def impl_and_env(self) -> tuple[str, dict[str, str] | None]:
        """A CS336 mutant is a student's tests/adapters.py: graded through adapters.cs336, as a
        course grades one; any other is the implementation itself."""
        if self.submission:
            return "parallelism_conformance.adapters.cs336", {"CS336_SUBMISSION": str(self.path)}
        if self.path.parent.name == PARALLELIZE:  # a team's function: graded through graded_args, beside the bundled impls
            return "parallelism_conformance.impls", None
        return str(self.path.relative_to(ROOT)), None

    def graded_args(self) -> list[str]:
        """What its run adds to the pytest arguments: a mutant under mutants/parallelize/ is a team's
        function, ``--parallelize <its file>:parallelize`` (CONTRACT.md, 'A parallelize function')."""
        if self.path.parent.name != PARALLELIZE:
            return []
        return ["--parallelize", f"{self.path.relative_to(ROOT)}:parallelize", "--capability", PARALLELIZE, "-k", "step_by_step"]


@dataclass(frozen=True)
class Outsider:
    path: Path  # a whole .py, or a .diff under <capability>/bugs/ against its author's correct file
    summary: str  # the docstring's first line: the bug, or "Correct: ..."
    verdict: str  # "pass" or "fail": what the suite must say
    capability: str  # what it claims (a capability or a group of harness/driver/capabilities.py)
    audit: str  # for a correct one whose communication exceeds the audit's bounds: why ('' otherwise)
    hang: bool = False  # its docstring says 'bug: hang': a deadline is a fair catch
    targets: str = ""  # a buggy one's 'targets:' line: the -k of its run (the tests that catch it), for speed

    @classmethod
    def read(cls, path: Path) -> Outsider:
        source = patched(path)[1] if path.suffix == ".diff" else path.read_text()
        doc = ast.get_docstring(ast.parse(source)) or ""
        lines = doc.splitlines()
        fields = {
            k.strip(): v.strip()
            for k, _, v in (line.partition(":") for line in lines[1:])
            if k.strip() in ("verdict", "capability", "audit", "bug", "targets")
        }
        verdict, capability = fields.get("verdict", ""), fields.get("capability", "")
        if not lines or verdict not in ("pass", "fail") or not (capability in BY_NAME or capability in GROUPS):
            raise ValueError(
                f"{path}: the docstring needs a first line, 'verdict: pass|fail' and 'capability: NAME' "
                f"(a capability or group of harness/driver/capabilities.py), got verdict={verdict!r}, "
                f"capability={capability!r}"
            )
        if fields.get("targets") and verdict != "fail":
            raise ValueError(f"{path}: only a buggy outsider may name 'targets:' (a correct one runs every test it claims)")
        return cls(path, lines[0], verdict, capability, fields.get("audit", ""), fields.get("bug") == "hang", fields.get("targets", ""))

    @property
    def name(self) -> str:
        """<capability folder>/<its file's stem>, a diff's too (e.g. collectives/bug_all_reduce_torch_chunk)."""
        folder = self.path.parent.parent if self.path.suffix == ".diff" else self.path.parent
        return f"{folder.name}/{self.path.stem}"

    def impl(self, scratch: Path) -> str:
        """The --impl of its run: a whole file's path from the root, or a diff written out (absolute)
        under scratch/<capability>/, world-readable (the ranks may run as another user)."""
        if self.path.suffix != ".diff":
            return str(self.path.relative_to(ROOT))
        folder = scratch / self.name.split("/")[0]
        folder.mkdir(mode=0o755, exist_ok=True)
        folder.chmod(0o755)
        return str(materialise(self.path, folder))

    def pytest_args(self) -> list[str]:
        """Its capability's conformance file and the communication audit of what it claims (the
        audit of a capability runs only when that capability is claimed)."""
        spec = BY_NAME.get(self.capability)
        test_file = spec.conformance if spec else next(c.conformance for c in CAPABILITIES if c.group == self.capability)
        if self.audit:  # its values alone; audit_args() holds its audit, which must fail
            return [test_file, "--capability", self.capability]
        args = [test_file, "conformance/audit", "--capability", f"{self.capability},audit"]
        if self.verdict == "pass":
            return args
        targeted = ["-k", self.targets] if self.targets else []
        return [*args, *targeted, "-x", "--rank-timeout", str(MUTANT_RANK_TIMEOUT_S)]

    def audit_args(self) -> list[str]:
        return ["conformance/audit", "--capability", f"{self.capability},audit", "-x", "--rank-timeout", str(MUTANT_RANK_TIMEOUT_S)]


def outsiders() -> list[Outsider]:
    """Every file under outsiders/<capability>/ and every diff under its bugs/, by name."""
    paths = [p for p in OUTSIDERS.glob("*/*.py") if p.name != "__init__.py"] + list(OUTSIDERS.glob("*/bugs/*.diff"))
    return sorted((Outsider.read(p) for p in paths), key=lambda o: o.name)


def known_good() -> list[tuple[str, list[str], dict[str, str]]]:
    """(implementation, pytest arguments, environment) that must pass: the bundled implementations
    (the naive DP variant too), torch.distributed's collectives, torch's own everything (DDP,
    DTensor, pipelining) through adapters/torch_native.py, and a CS336 assignment-2 submission
    (the project's own, tests/fixtures/cs336_submission) through adapters/cs336.py, under both
    handouts' names and both scopes."""
    runs = [
        ("parallelism_conformance.impls", ["conformance"]),
        ("torch.distributed", ["conformance/test_collectives.py", "conformance/audit", "--capability", "collectives,audit"]),
        # the naive variant of the bundled DP (bucket_size_mb ignored, every gradient all-reduced after
        # backward): a second opinion on the tests that hand it a bucket size or several backwards per
        # step, where a wrapper without buckets or hooks differs; fewer examples
        (
            "parallelism_conformance.impls.naive_dp",
            ["conformance/test_data_parallel.py", "-k", "bucket or accumulation or tied", "--hypothesis-profile=brief"],
        ),
        # every capability; context parallelism is skipped with torch's reason (not adapted). A second
        # opinion on the same tests as the first run, so fewer examples: under ci it was the runner's
        # longest run, under brief (10) about half as long (171 s beside tests/), under
        # second_opinion (5) every test still runs
        ("parallelism_conformance.adapters.torch_native", ["conformance", "--hypothesis-profile=second_opinion"]),
    ]
    # a team's parallelize function (--parallelize): torch's own plans of parallelize_examples/good.py, one
    # run each (the option takes one function), beside the bundled implementations; tensor_parallel and fsdp
    # alone are fsdp_tp's meshes of one dimension
    # the values only: the traffic test (one more task a mesh, never a failure unless bounds are
    # required) is tests/test_parallelize.py's, on the plans whose traffic it knows
    graded = ["--capability", "parallelize", "--hypothesis-profile=second_opinion", "-k", "step_by_step"]
    plans = ("fsdp_tp", "hsdp", "sequence_parallel", "ddp", "fsdp_checkpointed")
    runs += [
        ("parallelism_conformance.impls", [PARALLELIZE_FILE, "--parallelize", f"parallelize_examples/good.py:{p}", *graded]) for p in plans
    ]
    runs = [(impl, args, {}) for impl, args in runs]
    runs.append(
        (
            "parallelism_conformance.adapters.cs336",
            [
                "conformance/test_data_parallel.py",
                "conformance/test_sharded_optimizer.py",
                "conformance/audit",
                "--capability",
                "data_parallel,sharded_optimizer,audit",
                "--hypothesis-profile=brief",
            ],
            {"CS336_SUBMISSION": str(CS336_FIXTURE)},
        )
    )
    # the 2026 handout's names (get_ddp for every bucket size, get_fsdp) under the handout's scope
    # and, for its FSDP, the contract's
    newer = {"CS336_SUBMISSION": str(CS336_FIXTURE / "tests" / "adapters_newer.py")}
    runs.append(
        (
            "parallelism_conformance.adapters.cs336",
            [
                "conformance/test_data_parallel.py",
                "conformance/test_fully_sharded.py",
                "conformance/test_sharded_optimizer.py",
                "conformance/audit",
                "--capability",
                "data_parallel,fully_sharded,fsdp_compute_dtype,sharded_optimizer,audit",
                "--scope",
                "cs336",
                "--hypothesis-profile=brief",
            ],
            newer,
        )
    )
    runs.append(
        (
            "parallelism_conformance.adapters.cs336",
            [
                "conformance/test_fully_sharded.py",
                "conformance/audit",
                "--capability",
                "fully_sharded,fsdp_compute_dtype,audit",
                "--hypothesis-profile=brief",
            ],
            newer,
        )
    )
    return runs


def mutants() -> list[Mutant]:
    """Every mutant; a folder no capability of harness/driver/capabilities.py claims is an error, never skipped."""
    return [Mutant.read(p) for p in sorted(MUTANTS.glob("*/*.py")) if not p.name.startswith("_")]


def rotation(items: list, share: int, seed: str) -> list:
    """One in ``share`` of ``items`` per folder (``folder_of``: a capability's mutants, its outsiders' bugs), at least
    one of each folder, chosen by ``seed`` (the test command's: the commit's hash): items i of a folder
    (sorted by path) with (i + offset) % share == 0, the offset drawn from the seed and the folder, so
    that one commit always runs the same ones and each new commit another share of each folder. A
    share of 1 is every item."""
    if share <= 1:
        return list(items)
    folders: dict[str, list] = {}
    for item in items:
        folders.setdefault(folder_of(item), []).append(item)
    chosen = set()
    for name, members in folders.items():
        members = sorted(members, key=lambda item: str(item.path))
        offset = int(hashlib.sha1(f"{seed}/{name}".encode()).hexdigest(), 16)
        picked = [m for i, m in enumerate(members) if (i + offset) % share == 0] or [members[offset % len(members)]]
        chosen.update(id(m) for m in picked)
    return [item for item in items if id(item) in chosen]


def folder_of(item: Mutant | Outsider) -> str:
    """The capability folder an item sits in: mutants/<capability>/, outsiders/<capability>/bugs/."""
    return item.path.parent.parent.name if item.path.parent.name == "bugs" else item.path.parent.name


def rotated(all_mutants: list[Mutant], all_outsiders: list[Outsider], share: int, seed: str) -> tuple[list[Mutant], list[Outsider], str]:
    """The mutants and the outsiders a runner with ``--rotate share`` runs (every correct outsider;
    ``rotation`` of the mutants and of the buggy outsiders), and a line saying so ('' for every one)."""
    buggy = [o for o in all_outsiders if o.verdict == "fail"]
    chosen_mutants = rotation(all_mutants, share, seed)
    chosen_buggy = rotation(buggy, share, seed)
    chosen_outsiders = [o for o in all_outsiders if o.verdict == "pass" or o in chosen_buggy]
    if share <= 1:
        return chosen_mutants, chosen_outsiders, ""
    return (
        chosen_mutants,
        chosen_outsiders,
        f"rotation (one in {share} per capability, seed {seed}): {len(chosen_mutants)} of {len(all_mutants)} mutants, "
        f"{len(chosen_buggy)} of {len(buggy)} buggy outsiders; --rotate 1 runs every one",
    )
