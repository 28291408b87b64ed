"""The autograder zip, built with one command (``scripts/autograder``) from this checkout:

    scripts/autograder --expects student_impl.py --capability collectives,data_parallel,audit \\
        --rubric mycourse.toml --time-limit-minutes 10 --out autograder.zip
    scripts/autograder --expects cs336 --capability data_parallel,sharded_optimizer,audit \\
        --requirements course-packages.txt

Its root holds what the platform runs, ``setup.sh`` and ``run_autograder`` (from grading/gradescope/),
the course's choices (``autograder.json``, read by harness/driver/gradescope/run.py), the suite
(reference, impls, harness, conformance, adapters, grading, the contract) and ``requirements.lock``,
the versions setup.sh installs, with the course's own packages (``--requirements``; for ``--expects cs336``
the handout's, grading/cs336-requirements.txt, by default) listed in ``autograder.json``. Every choice is checked here, before anything is written, and the zip
is the same bytes for the same checkout and choices (sorted entries, fixed times), so a course can
tell two builds apart by their hash."""

from __future__ import annotations

import argparse
import hashlib
import sys
import zipfile
from pathlib import Path

from parallelism_conformance.harness.driver import capabilities
from parallelism_conformance.harness.driver.gradescope import requirements
from parallelism_conformance.harness.driver.gradescope.config import CS336, FILE_NAME, PLATFORM_DEFAULT_LIMIT_S, AutograderConfig, ConfigError

SUITE = Path(__file__).resolve().parents[3]
PLATFORM_FILES = ("setup.sh", "run_autograder")  # at the zip's root, where the platform looks for them
SUITE_FILES = ("pyproject.toml", "setup.py", "requirements.lock", "conftest.py", "CONTRACT.md", "README.md")
SUITE_FOLDERS = (
    "parallelism_conformance",
    "reference",
    "impls",
    "harness",
    "conformance",
    "adapters",
    "parallelize_examples",
    "grading",
    "starter",
)
COURSE_RUBRIC = "grading/course-rubric.toml"  # where a rubric given with --rubric goes in the zip
FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def suite_files(root: Path = SUITE) -> list[Path]:
    """The suite's files, relative to ``root``: no caches, no hidden files."""
    files = [Path(name) for name in SUITE_FILES]
    for folder in SUITE_FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            relative = path.relative_to(root)
            if path.is_file() and not any(part.startswith(".") or part == "__pycache__" for part in relative.parts) and path.suffix != ".pyc":
                files.append(relative)
    return files


def configure(args: argparse.Namespace) -> tuple[AutograderConfig, Path]:
    """The config the zip carries, and the rubric file it ships; raises ConfigError naming what is wrong."""
    from parallelism_conformance.harness.driver.reports import suite_version  # imports torch: only once the options parse
    from parallelism_conformance.harness.driver.rubric import load_rubric

    rubric_path = Path(args.rubric).resolve() if args.rubric else SUITE / "grading" / "rubric.toml"
    try:
        rubric = load_rubric(rubric_path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"--rubric: {error}") from None
    chosen = args.requirements or (requirements.CS336_DEFAULT if args.expects == CS336 else None)
    try:
        packages = requirements.read_file(Path(chosen)) if chosen else ()
    except requirements.RequirementError as error:
        raise ConfigError(f"--requirements: {error}") from None
    config = AutograderConfig(
        expects=args.expects,
        capability=args.capability,
        requirements=packages,
        rubric=COURSE_RUBRIC if args.rubric else "grading/rubric.toml",
        time_limit_s=args.time_limit_minutes * 60,
        points_possible=args.points_possible,
        contain_ranks=args.contain_ranks,
        reject_grader_access=args.reject_grader_access,
        suite_version=suite_version(),
    ).check()
    unpriced = sorted(capabilities.select(config.capability) - set(rubric))
    if unpriced and args.capability:  # every capability claimed by name must be worth something known
        raise ConfigError(
            f"--capability: the rubric {rubric_path} gives no points to {', '.join(unpriced)}; add them to "
            "its [capabilities] (0 is allowed) or leave them out of --capability"
        )
    return config, rubric_path


def build(config: AutograderConfig, rubric_path: Path, out: Path, root: Path = SUITE) -> str:
    """Write the zip; return its sha256."""
    entries: list[tuple[str, bytes, int]] = []
    for name in PLATFORM_FILES:
        entries.append((name, (root / "grading" / "gradescope" / name).read_bytes(), 0o755))
    entries.append((FILE_NAME, config.to_json().encode(), 0o644))
    for relative in suite_files(root):
        mode = 0o755 if (root / relative).stat().st_mode & 0o100 else 0o644
        entries.append((relative.as_posix(), (root / relative).read_bytes(), mode))
    if config.rubric == COURSE_RUBRIC:
        entries.append((COURSE_RUBRIC, rubric_path.read_bytes(), 0o644))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data, mode in sorted(entries):
            info = zipfile.ZipInfo(name, FIXED_TIME)
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    partial.replace(out)
    return hashlib.sha256(out.read_bytes()).hexdigest()


def arguments() -> argparse.ArgumentParser:
    """scripts/autograder's options (the tests parse theirs with it too, so an option added here is
    never missing from what they build)."""
    parser = argparse.ArgumentParser(prog="scripts/autograder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("autograder.zip"))
    parser.add_argument(
        "--expects",
        default="student_impl.py",
        help=f"the submission's file, relative to its root, or {CS336!r} for a CS336 assignment 2 "
        "repository (graded through parallelism_conformance.adapters.cs336)",
    )
    parser.add_argument(
        "--capability", default=None, metavar="NAME[,NAME]", help="what the submission is graded on (names or groups; default every capability)"
    )
    parser.add_argument("--rubric", default=None, help="the course's rubric (default grading/rubric.toml)")
    parser.add_argument(
        "--time-limit-minutes",
        type=float,
        default=PLATFORM_DEFAULT_LIMIT_S / 60,
        help="the time limit set on the platform (default 10, at most 40): the suite's budget is taken from it",
    )
    parser.add_argument(
        "--requirements",
        default=None,
        metavar="FILE",
        help="the course's packages, name==version a line, installed by setup.sh beside the lock "
        "(never changing what it pins); default for --expects cs336: the handout's runtime "
        "packages (grading/cs336-requirements.txt)",
    )
    parser.add_argument("--points-possible", type=float, default=None, help="scale the total to this")
    parser.add_argument(
        "--contain-ranks",
        default="yes",
        choices=("yes", "no"),
        help="no: grade uncontained where the platform cannot contain ranks (the report says so)",
    )
    parser.add_argument(
        "--reject-grader-access",
        action="store_true",
        help="a submission whose own files reach into the grader scores 0, saying why (default: flagged for review; docs/options.md)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    try:
        config, rubric_path = configure(args)
    except ConfigError as error:
        parser.exit(2, f"scripts/autograder: {error}\n")
    digest = build(config, rubric_path, args.out)
    print(
        f"{args.out}: sha256 {digest}\n  expects {config.expects}; capabilities "
        f"{config.capability or 'every one'}; rubric {rubric_path}; time limit {config.time_limit_s / 60:g} min"
        f"{'; ranks NOT contained' if config.contain_ranks == 'no' else ''}"
        f"; course packages: {', '.join(config.requirements) or 'none'}\n"
        "  upload it as the assignment's autograder (Gradescope: Configure Autograder, zip file upload, "
        "Ubuntu 22.04 base image)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
