"""What a course chose when it built its autograder (``scripts/autograder``), written into the zip as
``autograder.json`` and read back by ``run_autograder``: which capabilities the submission is graded
on, the rubric, what the submission is (one file of the contract, or a CS336 repository), the
platform's time limit, the total to scale to, and the course's own packages installed beside the
suite (``requirements``: what submissions import that the suite does not, such as a CS336 handout's
einops and triton). Every value is checked when the zip is built and
again when it is read, and a bad one is a :class:`ConfigError` naming the key."""

from __future__ import annotations

import json
import posixpath
from dataclasses import asdict, dataclass
from pathlib import Path

from parallelism_conformance.harness.driver import capabilities
from parallelism_conformance.harness.driver.gradescope.requirements import RequirementError, check_requirements

FILE_NAME = "autograder.json"
CS336 = "cs336"  # ``expects``: a CS336 assignment 2 repository, graded through adapters.cs336
PLATFORM_DEFAULT_LIMIT_S = 600  # Gradescope's default time limit (10 minutes; 40 at most)
PLATFORM_MAX_LIMIT_S = 2400
CONTAIN_CHOICES = ("yes", "no")
BUNDLED_CHOICES = ("reject", "report")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class AutograderConfig:
    expects: str  # the submission's file, relative to its root ("student_impl.py"), or CS336
    capability: str | None = None  # --capability: names and groups, comma-separated; None: every one
    rubric: str = "grading/rubric.toml"  # relative to the suite's root inside the zip
    time_limit_s: float = PLATFORM_DEFAULT_LIMIT_S  # what the course set on the platform
    points_possible: float | None = None
    contain_ranks: str = "yes"  # "no" only where the platform cannot contain ranks (the report says so)
    suite_version: str = ""
    requirements: tuple[str, ...] = ()  # "name==version", installed by setup.sh under the lock's constraints
    # --bundled-code: a capability taken from the suite's bundled code scores 0 ("reject"), or is only
    # reported ("report": the project's own trials of attacks built on the bundled code)
    bundled_code: str = "reject"
    reject_grader_access: bool = False  # --reject-grader-access: a reach into the grader scores 0, not flagged

    def __post_init__(self):
        if isinstance(self.requirements, list):  # as JSON gives it back
            object.__setattr__(self, "requirements", tuple(self.requirements))

    @property
    def is_cs336(self) -> bool:
        return self.expects == CS336

    def check(self) -> AutograderConfig:
        """Raises ConfigError naming the first bad key; returns self."""
        if not self.is_cs336 and (
            not self.expects.endswith(".py")
            or posixpath.isabs(self.expects)
            or ".." in posixpath.normpath(self.expects).split("/")
            or "\\" in self.expects
        ):
            raise ConfigError(
                f"expects = {self.expects!r}: expected a .py file relative to the submission's root "
                f"(e.g. student_impl.py) or {CS336!r} (a CS336 assignment 2 repository)"
            )
        try:
            capabilities.select(self.capability)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if not 60 <= self.time_limit_s <= PLATFORM_MAX_LIMIT_S:
            raise ConfigError(
                f"time_limit_s = {self.time_limit_s!r}: the platform allows 60 to "
                f"{PLATFORM_MAX_LIMIT_S} seconds (its default is {PLATFORM_DEFAULT_LIMIT_S})"
            )
        if self.points_possible is not None and not 0 < self.points_possible < float("inf"):
            raise ConfigError(f"points_possible = {self.points_possible!r}: expected a positive number of points")
        if not isinstance(self.requirements, tuple):
            raise ConfigError(f"requirements = {self.requirements!r}: expected a list of name==version")
        try:
            check_requirements(self.requirements)
        except RequirementError as error:
            raise ConfigError(f"requirements: {error}") from None
        if self.bundled_code not in BUNDLED_CHOICES:
            raise ConfigError(f"bundled_code = {self.bundled_code!r}: expected one of {', '.join(BUNDLED_CHOICES)}")
        if not isinstance(self.reject_grader_access, bool):
            raise ConfigError(f"reject_grader_access = {self.reject_grader_access!r}: expected true or false")
        if self.contain_ranks not in CONTAIN_CHOICES:
            raise ConfigError(f"contain_ranks = {self.contain_ranks!r}: expected one of {', '.join(CONTAIN_CHOICES)}")
        return self

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


def load(path: Path) -> AutograderConfig:
    """The config in ``path``, checked."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    known = set(AutograderConfig.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
    if "expects" not in data:
        raise ConfigError(f"{path}: no 'expects' (the submission's file, or {CS336!r})")
    try:
        return AutograderConfig(**data).check()
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
