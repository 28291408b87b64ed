"""The process boundary: what runs inside a rank, next to the code under test, never reaches the
oracle, the tests or the grading code (an implementation that could call them would prove nothing,
and could learn expected values). Walks the imports of every module of harness.rank."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGE = "parallelism_conformance."  # the one import name; module names below are relative to it
DRIVER_ONLY = ("reference", "conformance", "tests", "grading", "harness.driver")


def _module_path(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(name: str, path: Path) -> set[str]:
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    found = {m.removeprefix(PACKAGE) for m in found if m}
    return {m for m in found if _module_path(m) is not None}


def _package_modules(package: str) -> list[str]:
    folder = ROOT / Path(*package.split("."))
    return sorted(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for path in folder.rglob("*.py"))


def rank_side() -> set[str]:
    """Every module of harness.rank and everything they import, transitively (the tree's own modules)."""
    seen, todo = set(), _package_modules("harness.rank")
    while todo:
        name = todo.pop()
        if name in seen or _module_path(name) is None:
            continue
        seen.add(name)
        todo.extend(_imports(name, _module_path(name)))
    return seen


def test_the_rank_side_never_reaches_the_oracle_the_tests_or_the_grading_code():
    modules = rank_side()
    assert "harness.rank.loop" in modules and "harness.rank.programs.collectives" in modules
    crossing = sorted(m for m in modules if m.startswith(DRIVER_ONLY))
    assert not crossing, f"rank-side code imports driver-only modules: {crossing}"


def test_every_harness_module_is_on_one_side_of_the_boundary():
    """A new module of the harness must say where it runs: in a rank (harness.rank) or in the driver
    (harness.driver). The package's own __init__ holds nothing but its docstring."""
    loose = [m for m in _package_modules("harness") if m != "harness" and not m.startswith(("harness.rank", "harness.driver"))]
    assert not loose, f"harness modules outside harness.rank and harness.driver: {loose}"
    top = ast.parse((ROOT / "harness" / "__init__.py").read_text()).body
    assert len(top) == 1 and isinstance(top[0], ast.Expr), "harness/__init__.py must hold only its docstring"


def test_ranks_preload_only_rank_side_modules():
    """What the forkserver imports into every rank before the implementation loads."""
    from parallelism_conformance.harness.rank.preload import PRELOAD

    ours = [m.removeprefix(PACKAGE) for m in PRELOAD if m.startswith(PACKAGE)]
    assert ours and all(m.startswith("harness.rank") for m in ours), PRELOAD
