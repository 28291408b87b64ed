"""A library's configuration space (issue 56): drawn per example, shrunk toward the library's
defaults, reported as the keys away from them, and told to the ranks on every task of a library
adapter only (conformance/library_configurations.py, harness/driver/plugin/fixtures.py's Ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import find

from parallelism_conformance.conformance import library_configurations as configurations
from parallelism_conformance.harness.driver.libraries.library import Library, Setting
from parallelism_conformance.harness.driver.libraries.table import LIBRARIES
from parallelism_conformance.harness.driver.plugin.fixtures import Ranks
from parallelism_conformance.harness.rank import library_loop

SETTINGS = (
    Setting("zero_optimization.overlap_comm", (False, True), ("sharded_optimizer",)),
    Setting("zero_optimization.reduce_bucket_size", (500, 64, 8), ("sharded_optimizer",)),
    Setting("prescale_gradients", (False, True), ("sharded_optimizer", "data_parallel")),
)
LIBRARY = Library(name="somelib", pinned="1.0", runs=(), settings=SETTINGS, averages_micro_batches="its engine divides by k")


def test_a_failure_shrinks_to_the_fewest_keys_away_from_the_defaults():
    """A bug that shows only with a small bucket: the minimal failing configuration moves that key
    alone, to the first value that fails, and the description names it alone."""
    failing = find(configurations.configurations(SETTINGS), lambda c: c["zero_optimization.reduce_bucket_size"] < 500)
    assert failing == {"zero_optimization.overlap_comm": False, "zero_optimization.reduce_bucket_size": 64, "prescale_gradients": False}
    assert configurations.away_from_default(SETTINGS, failing) == {"zero_optimization.reduce_bucket_size": 64}
    said = configurations.describe(LIBRARY, SETTINGS, failing)
    assert '{"zero_optimization.reduce_bucket_size": 64}' in said and "overlap_comm" not in said
    assert "its defaults for every drawn key" in configurations.describe(LIBRARY, SETTINGS, {s.key: s.default for s in SETTINGS})


def test_the_space_is_the_capabilitys_keys_and_a_test_without_one_is_skipped_saying_why():
    ranks = SimpleNamespace(library=LIBRARY)
    assert [s.key for s in configurations.space(ranks, "data_parallel")] == ["prescale_gradients"]
    with pytest.raises(pytest.skip.Exception, match="declares no keys its users set for it"):
        configurations.space(ranks, "fully_sharded")
    with pytest.raises(pytest.skip.Exception, match="not a listed library's adapter"):
        configurations.space(SimpleNamespace(library=None), "data_parallel")


def test_a_key_newer_than_the_installed_version_is_not_drawn():
    newer = Library(name="pytest", pinned="1", runs=(), settings=(Setting("far_future", (True, False), ("data_parallel",), since="999.0"),))
    with pytest.raises(pytest.skip.Exception):
        configurations.space(SimpleNamespace(library=newer), "data_parallel")


class _Pool:
    perturb = False

    def __init__(self):
        self.sent = None

    def run(self, world_size, program, args, **_):
        self.sent = args
        return SimpleNamespace(outputs={r: {} for r in range(world_size)}, late=[])


def test_every_task_of_a_library_adapter_carries_the_configuration_and_no_other_implementations_does():
    pool = _Pool()
    ranks = Ranks(pool, SimpleNamespace(impl="x", perturb="off"), library=LIBRARY)
    ranks.configuration = {"prescale_gradients": True}
    ranks.run(3, [0, 1], "probe:echo", [{"a": 1}, {"a": 2}])
    assert [a["library_configuration"] for a in pool.sent] == [{"prescale_gradients": True}] * 3  # the non-member too
    ranks.configuration = {}
    ranks.run(2, None, "probe:echo", [{}, {}])
    assert [a["library_configuration"] for a in pool.sent] == [{}, {}]  # the defaults, said: a world reused after a draw is reset
    plain = Ranks(pool, SimpleNamespace(impl="x", perturb="off"))
    plain.run(2, None, "probe:echo", [{}, {}])
    assert all("library_configuration" not in a for a in pool.sent)
    assert ranks.micro_batch_scale(4) == 0.25 and plain.micro_batch_scale(4) == 1.0


def test_an_implementation_without_configure_is_told_so_by_name():
    with pytest.raises(NotImplementedError, match="without configure"):
        library_loop.configure(SimpleNamespace(), {"k": 1})
    seen = []
    library_loop.configure(SimpleNamespace(configure=seen.append), {"k": 1})
    assert seen == [{"k": 1}]


def test_every_library_declares_its_configuration_space_or_says_why_not():
    for library in LIBRARIES.values():
        assert library.settings or library.settings_note, f"{library.name}: no settings and no settings_note"
        for setting in library.settings:
            assert len(setting.values) >= 2 and len(set(map(repr, setting.values))) == len(setting.values), setting
            assert setting.capabilities and setting.why, setting


def test_every_adapter_a_configuration_reaches_has_configure():
    import importlib

    for library in LIBRARIES.values():
        for run in library.runs:
            if any(library.settings_for(c) for c in run.capabilities):
                assert callable(getattr(importlib.import_module(run.adapter), "configure", None)), f"{library.name} {run.label}: {run.adapter}"
