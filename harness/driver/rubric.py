"""The rubric course staff edit (TOML): points per capability, test weights, Gradescope's visibility
and output settings. Read once, before any rank starts; every key it does not know is refused with
the file and key named, never ignored. Imports no torch: the autograder's builder reads it too."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

DEFAULT_RUBRIC = Path(__file__).resolve().parents[2] / "grading" / "rubric.toml"

# Gradescope's values (its autograder specification): when a student sees a test, and how a text is shown
VISIBILITIES = ("visible", "hidden", "after_due_date", "after_published")
FORMATS = ("text", "html", "simple_format", "md", "ansi")
# The rubric's top-level keys and tables; any other is a typo, refused rather than ignored
_SCALARS = ("points_possible", "stdout_visibility", "output_format", "test_output_format")
_TABLES = ("capabilities", "weights", "visibility")


class Rubric(dict):
    """{capability: points}, plus what the course sets around them:

    - ``weights``: {test function name: relative weight within its capability} (default 1). A
      capability's points are shared among its tests that ran in proportion to their weights.
    - ``visibility``: {capability or test function name: Gradescope visibility}; the key
      ``default`` is the results' own visibility and that of every test not listed.
    - ``points_possible``: the maximum the points that ran are scaled to (None: not scaled).
    - ``stdout_visibility``, ``output_format``, ``test_output_format``: Gradescope's.
    """

    def __init__(
        self,
        points: dict[str, float],
        weights: dict[str, float] | None = None,
        *,
        visibility: dict[str, str] | None = None,
        points_possible: float | None = None,
        stdout_visibility: str = "hidden",
        output_format: str = "text",
        test_output_format: str = "text",
    ):
        super().__init__(points)
        self.weights = dict(weights or {})
        self.visibility = dict(visibility or {})
        self.points_possible = points_possible
        self.stdout_visibility = stdout_visibility
        self.output_format = output_format
        self.test_output_format = test_output_format

    def weight(self, nodeid: str) -> float:
        return self.weights.get(function_name(nodeid), 1.0)

    def default_visibility(self) -> str:
        return self.visibility.get("default", "visible")

    def visibility_of(self, capability: str, nodeid: str | None = None) -> str:
        """A test's visibility: its function's entry, else its capability's, else ``default``."""
        if nodeid is not None and function_name(nodeid) in self.visibility:
            return self.visibility[function_name(nodeid)]
        return self.visibility.get(capability, self.default_visibility())


def function_name(nodeid: str) -> str:
    """The test function of a node id, without its file and parameters: the rubric's key for it."""
    return nodeid.split("::", 1)[-1].split("[", 1)[0]


def load_rubric(path: Path) -> Rubric:
    """The rubric at ``path``, every key and value checked: a bad one is a ValueError naming the
    file and the key (the plugin makes it a usage error, before any rank starts)."""
    with open(path, "rb") as file:
        data = tomllib.load(file)
    unknown = sorted(set(data) - set(_SCALARS) - set(_TABLES))
    if unknown:
        raise ValueError(
            f"{path}: unknown key {unknown[0]!r}; a rubric has the tables "
            f"{', '.join(f'[{t}]' for t in _TABLES)} and the keys {', '.join(_SCALARS)}"
        )
    points = _points_table(path, data, "capabilities", required=True)
    return Rubric(
        points,
        _points_table(path, data, "weights"),
        visibility=_visibility_table(path, data.get("visibility", {}), points),
        points_possible=_points_possible(path, data.get("points_possible")),
        stdout_visibility=_choice(path, "stdout_visibility", data.get("stdout_visibility", "hidden"), VISIBILITIES),
        output_format=_choice(path, "output_format", data.get("output_format", "text"), FORMATS),
        test_output_format=_choice(path, "test_output_format", data.get("test_output_format", "text"), FORMATS),
    )


def _is_number(value) -> bool:
    """A finite TOML number: ``true`` is a bool (an int to Python) and ``inf`` cannot be split into cents."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _points_table(path: Path, data: dict, table: str, required: bool = False) -> dict[str, float]:
    values = data.get(table, None if required else {})
    if not isinstance(values, dict) or not all(_is_number(v) and v >= 0 for v in values.values()):
        raise ValueError(f"{path}: expected a [{table}] table of non-negative points")
    return {str(k): float(v) for k, v in values.items()}


def _visibility_table(path: Path, values, points: dict[str, float]) -> dict[str, str]:
    """[visibility]: each key is ``default``, a capability of [capabilities] or a test function
    (test_...); each value one of Gradescope's VISIBILITIES."""
    if not isinstance(values, dict):
        raise ValueError(f"{path}: visibility = {values!r}: expected a [visibility] table (its key default sets the results' own visibility)")
    for key, value in values.items():
        if key != "default" and key not in points and not function_name(key).split("::")[-1].startswith("test"):
            raise ValueError(
                f"{path}: [visibility] {key!r} is neither 'default', a capability of [capabilities] nor a test function (test_...)"
            )
        _choice(path, f"[visibility] {key}", value, VISIBILITIES)
    return dict(values)


def _choice(path: Path, key: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{path}: {key} = {value!r}: expected one of {', '.join(choices)}")
    return value


def _points_possible(path: Path, value) -> float | None:
    if value is not None and not (_is_number(value) and value > 0):
        raise ValueError(f"{path}: points_possible = {value!r}: expected a positive number of points")
    return None if value is None else float(value)
