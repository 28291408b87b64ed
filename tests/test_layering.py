"""The process boundary: what runs inside a rank, next to the code under test, never reaches the
oracle, the tests or the grading code (an implementation that could call them would prove nothing,
and could learn expected values). Walks the rank side's imports from its entry points."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
RANK_ENTRY_POINTS = ["harness.rank", "harness.programs"]  # what ranks import (the forkserver preloads them)
DRIVER_ONLY = ("reference", "conformance", "tests", "harness.reports", "harness.scorecard", "harness.pytest_plugin",
               "harness.capabilities", "harness.audit", "harness.mutation", "harness.world", "harness.pool")


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
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {m for m in found if _module_path(m) is not None}


def rank_side() -> set[str]:
    seen, todo = set(), list(RANK_ENTRY_POINTS)
    for path in (ROOT / "harness" / "programs").glob("*.py"):
        todo.append(f"harness.programs.{path.stem}")
    while todo:
        name = todo.pop()
        if name in seen or _module_path(name) is None:
            continue
        seen.add(name)
        todo.extend(_imports(name, _module_path(name)))
    return seen


def test_the_rank_side_never_reaches_the_oracle_the_tests_or_the_grading_code():
    modules = rank_side()
    assert "harness.rank" in modules and "harness.programs.collectives" in modules
    crossing = sorted(m for m in modules if m.startswith(DRIVER_ONLY))
    assert not crossing, f"rank-side code imports driver-only modules: {crossing}"
