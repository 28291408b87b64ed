"""A training library in the configurations its users set (issue 56): each library's table entry
(harness/driver/libraries/table.py) declares the keys its users set and the values drawn for each,
its own default first. A test draws one value per key next to its model and batch; Hypothesis
shrinks every ``sampled_from`` toward its first value, so a failing configuration shrinks toward the
library's defaults and the report names the smallest set of keys away from them, as JSON.

The draw reaches the ranks through ``Ranks.configuration``: every task of the test carries it, and the
rank loop hands it to the adapter's ``configure`` before the program builds anything
(harness/rank/library_loop.py). A key the installed version lacks, or a value it rejects, is the
adapter's refusal with the library's words (not run, named), never a failure.

Only a listed library's adapter has a configuration space: for any other implementation, and under
the grading profile, the tests that draw one are skipped, saying why (decided here, in the driver)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json

import pytest
from hypothesis import strategies as st
from packaging.version import Version


def installed(library) -> Version | None:
    """The library's version in this environment (the driver runs in its venv), without importing it."""
    try:
        return Version(importlib.metadata.version(library.name))
    except importlib.metadata.PackageNotFoundError:
        return None


def space(ranks, capability: str) -> tuple:
    """The keys users set on the library runs that map ``capability`` and that the installed version
    has (a key newer than it is not drawn: ``Setting.since``); skips the test where none."""
    library = ranks.library
    settings = library.settings_for(capability) if library is not None else ()
    version = installed(library) if settings else None
    settings = tuple(s for s in settings if not s.since or version is None or version >= Version(s.since))
    if not settings:
        pytest.skip(
            f"no configuration space for {capability}: "
            + (
                f"{library.name}'s table entry declares no keys its users set for it{': ' + library.settings_note if library.settings_note else ''}"
                if library is not None
                else "the implementation under test is not a listed library's adapter (harness/driver/libraries/table.py)"
            )
        )
    return settings


def configurations(settings) -> st.SearchStrategy[dict]:
    """One value per key, each shrinking toward the library's default (its first value)."""
    return st.fixed_dictionaries({s.key: st.sampled_from(s.values) for s in settings})


def away_from_default(settings, configuration: dict) -> dict:
    """The keys whose drawn value is not the library's default: what a failure's report names."""
    defaults = {s.key: s.default for s in settings}
    return {key: value for key, value in configuration.items() if value != defaults[key]}


def describe(library, settings, configuration: dict) -> str:
    changed = away_from_default(settings, configuration)
    if not changed:
        return f"{library.name}'s configuration: its defaults for every drawn key ({', '.join(s.key for s in settings)})"
    return f"{library.name}'s configuration, the keys away from its defaults: {json.dumps(changed, sort_keys=True)}"


@contextlib.contextmanager
def drawn(data, ranks, capability: str):
    """Draws a configuration of the library under test for ``capability`` and holds it as every
    task's (``ranks.configuration``) until the block ends; yields its description for the judge."""
    settings = space(ranks, capability)
    configuration = data.draw(configurations(settings), label="configuration")
    ranks.configuration = dict(configuration)
    newer = [f"{s.key} (since {s.since})" for s in ranks.library.settings_for(capability) if s not in settings]
    said = f"; not drawn on {ranks.library.name} {installed(ranks.library)}, which lacks them: {', '.join(newer)}" if newer else ""
    try:
        yield describe(ranks.library, settings, configuration) + said
    finally:
        ranks.configuration = {}


def accumulated(micro_batches: int, scale: float) -> str:
    """How a step's gradient adds its micro-batches up, for a judge's message."""
    if micro_batches == 1:
        return ""
    return ", summed over the micro-batches" if scale == 1.0 else f", the mean over the {micro_batches} micro-batches (the library's count)"
