"""The capability registry (harness/driver/capabilities.py) against everything that names a capability
or a name an implementation provides: one place per fact, checked here."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from parallelism_conformance.harness.driver import capabilities
from parallelism_conformance.harness.driver.capabilities import CAPABILITIES, COLLECTIVES
from parallelism_conformance.harness.driver.mutation_catalog import mutants, outsiders
from parallelism_conformance.harness.driver.rubric import DEFAULT_RUBRIC, load_rubric

ROOT = Path(__file__).parent.parent


def test_the_rubric_scores_exactly_the_registered_capabilities():
    assert set(load_rubric(DEFAULT_RUBRIC)) == set(capabilities.BY_NAME)


def test_every_capability_marker_in_conformance_is_registered_and_every_capability_has_tests():
    used = set()
    for path in (ROOT / "conformance").rglob("test_*.py"):
        text = path.read_text()
        for name in re.findall(r"capability\(\"(\w+)\"\)", text):
            assert name in capabilities.BY_NAME, f"{path.name}: capability {name!r} is not in the registry"
            registered = ROOT / capabilities.BY_NAME[name].conformance  # its file, or the folder that holds it
            assert path == registered or registered in path.parents, (path, registered)
            used.add(name)
        if "capability(collective)" in text:  # the collectives' parametrized tests
            used.update(COLLECTIVES)
    assert used == set(capabilities.BY_NAME)


def test_every_file_a_capability_names_exists_and_so_does_its_contract_section():
    headings = [line for line in (ROOT / "CONTRACT.md").read_text().splitlines() if line.startswith("#")]
    for capability in CAPABILITIES:
        missing = [name for name in (capability.conformance, *capability.files) if not (ROOT / name).exists()]
        assert not missing, f"{capability.name}: the registry names {missing}, which do not exist"
        assert capability.files, f"{capability.name}: the registry names none of its files"
        if capability.name != "audit":  # whose rules sit in each strategy's section
            assert any(capability.contract and capability.contract in h for h in headings), (
                f"{capability.name}: no CONTRACT.md heading holds {capability.contract!r}"
            )
    # and every file of those folders belongs to a capability, but what all of them share
    shared = {"reference/likely_bugs.py", "harness/rank/programs/probe.py", "harness/rank/programs/timing.py"}
    named = {name for c in CAPABILITIES for name in c.files} | shared
    for folder in ("reference", "impls", "harness/rank/programs", "adapters", "outsiders"):
        orphans = [
            str(p.relative_to(ROOT))
            for p in (ROOT / folder).iterdir()
            if not p.name.startswith(("_", ".")) and str(p.relative_to(ROOT)) not in named
        ]
        assert not orphans, f"{orphans}: no capability of harness/driver/capabilities.py names them"


def test_every_mutants_folder_belongs_to_a_capability_and_every_mutant_is_run():
    folders = {p.name for p in (ROOT / "mutants").iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert folders == {c.mutants for c in CAPABILITIES if c.mutants}
    assert len(mutants()) == sum(1 for p in (ROOT / "mutants").glob("*/*.py") if not p.name.startswith("_"))


def test_every_implementation_written_from_the_contract_alone_says_what_it_claims_and_is_run():
    """outsiders/: each file's docstring (a bug's diff's too) states its bug (or that it is correct),
    the verdict the suite must give and a registered capability (Outsider.read raises otherwise)."""
    every = outsiders()
    files = sum(1 for p in (ROOT / "outsiders").glob("*/*.py") if p.name != "__init__.py")
    assert len(every) == files + len(list((ROOT / "outsiders").glob("*/bugs/*.diff")))
    assert {o.verdict for o in every} == {"pass", "fail"}
    assert all(capabilities.BY_NAME.get(o.capability) or o.capability in capabilities.GROUPS for o in every)


def _top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_the_starter_and_the_bundled_implementation_provide_every_registered_name():
    from parallelism_conformance import impls

    starter = _top_level_names(ROOT / "starter" / "student_impl.py")
    for name in capabilities.provided_names():
        assert name in starter, f"starter/student_impl.py lacks {name}"
        assert hasattr(impls, name), f"impls lacks {name}"


@pytest.mark.parametrize("name", COLLECTIVES)
def test_each_collective_has_torch_distributeds_signature_in_the_starter_and_impls(name):
    """Parameter names, order and defaults as torch.distributed has them (its own module is a valid
    implementation, so a student's must take the same call)."""
    from parallelism_conformance import impls

    namespace: dict = {}
    exec(compile((ROOT / "starter" / "student_impl.py").read_text(), "student_impl.py", "exec"), namespace)
    want = _parameters(getattr(dist, name))
    assert _parameters(namespace[name]) == want, f"starter {name}"
    assert _parameters(getattr(impls, name)) == want, f"impls {name}"


def _parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


def test_an_unknown_capability_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="no capability or group 'fsdp'; known: collectives"):
        capabilities.select("collectives,fsdp")
    assert capabilities.select("collectives") == frozenset(COLLECTIVES) | {"equivalences"}


def test_the_capability_table_is_the_registry_s():
    """docs/capabilities.md's table of capabilities and files is generated
    (harness/driver/capability_table.py): a capability added, renamed or given another file changes
    it, and a hand edit is caught here."""
    from parallelism_conformance.harness.driver import capability_table

    text = capability_table.TABLE.read_text()
    assert capability_table.replaced(text) == text, (
        "docs/capabilities.md's table differs from the registry: run python -m parallelism_conformance.harness.driver.capability_table"
    )
    with pytest.raises(ValueError, match="markers"):
        capability_table.replaced(text.replace(capability_table.BEGIN, ""))
