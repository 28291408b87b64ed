"""The course's own packages (``autograder.json``'s ``requirements``): what its submissions import
that the suite does not, installed by setup.sh when the platform builds the image, so that nothing
is downloaded while a submission is graded.

Each is pinned (``name==version``: the image a course builds twice is the same image), and none may
change what ``requirements.lock`` pins (torch, numpy, pytest, hypothesis: the examples a student
draws locally are those drawn on the grader only under the same versions). setup.sh installs them
with the lock as pip's constraints, so a package that would need another torch fails the image's
build, naming it, instead of replacing torch."""

from __future__ import annotations

import re
from pathlib import Path

SUITE = Path(__file__).resolve().parents[3]
LOCK = SUITE / "requirements.lock"
CS336_DEFAULT = SUITE / "grading" / "cs336-requirements.txt"  # the handout's runtime packages
_PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)$")


class RequirementError(ValueError):
    pass


def canonical(name: str) -> str:
    """PEP 503's normalised name: ``Wadler_Lindig`` and ``wadler-lindig`` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines: list[str]) -> dict[str, tuple[str, str]]:
    """{canonical name: (line, version)} of pinned lines; comments and blank lines skipped."""
    found = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if line:
            match = _PINNED.match(line)
            if match:
                found[canonical(match.group(1))] = (line, match.group(2))
    return found


def read_file(path: Path) -> tuple[str, ...]:
    """The requirements of a file, one per line, comments and blank lines dropped (each checked)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise RequirementError(f"{path}: {error.strerror or error}") from None
    lines = tuple(line.split("#", 1)[0].strip() for line in text.splitlines())
    return check_requirements(tuple(line for line in lines if line), where=str(path))


def check_requirements(requirements: tuple[str, ...], where: str = "", lock: Path = LOCK) -> tuple[str, ...]:
    """``requirements`` if every one is ``name==version``, named once, and agrees with the lock;
    RequirementError naming the first that is not."""
    prefix = f"{where}: " if where else ""
    locked = pins(lock.read_text().splitlines()) if lock.exists() else {}
    seen: set[str] = set()
    for requirement in requirements:
        if not isinstance(requirement, str):
            raise RequirementError(f"{prefix}{requirement!r} is not a string")
        match = _PINNED.match(requirement.strip())
        if not match:
            raise RequirementError(
                f"{prefix}{requirement!r}: expected a pinned package, name==version (no options, "
                "URLs, ranges or markers: the image must be the same every time it is built)"
            )
        name, version = canonical(match.group(1)), match.group(2)
        if name in seen:
            raise RequirementError(f"{prefix}{match.group(1)} is named twice")
        seen.add(name)
        if name in locked and locked[name][1] != version:
            raise RequirementError(
                f"{prefix}{requirement}: requirements.lock pins {locked[name][0]}, which the suite "
                "runs on; a course's packages may not change it"
            )
    return tuple(requirement.strip() for requirement in requirements)
