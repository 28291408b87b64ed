"""The reaches into the grader in one file of the submission, found by reading it (ast): what code
under test would use to change the suite rather than be graded by it. Each is a fact about the text,
decided by the driver before any rank starts; the rubric decides what it costs (flagged for review
by default, 0 under --reject-grader-access).

What counts, and what an honest submission does instead:

* an import of the suite's modules (parallelism_conformance, or its folders by their bare names
  where a checkout is on the path): a contract implementation needs none of them;
* ``sys.modules``, ``gc``, ``ctypes``, ``builtins``/``__builtins__``: the ways to find and replace
  the suite's objects in a rank's memory;
* ``importlib``, except ``importlib.metadata`` (a CS336 package reads its version with it);
* ``exec``, ``eval``, ``compile``, ``__import__``: code the reading cannot see;
* a write on an imported module or object (``torch.distributed.all_reduce = ...``, ``setattr(dist,
  ...)``, ``del``, its ``__dict__``), except torch's settings under ``torch.backends``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from parallelism_conformance.harness.driver.submission.files import SUITE_FOLDERS, SUITE_PACKAGE

MEMORY_MODULES = ("gc", "ctypes", "_ctypes", "builtins")
HIDDEN_CODE = ("exec", "eval", "compile", "__import__")
SETTINGS = ("torch.backends",)  # writes there are configuration, not code under someone else's name


@dataclass(frozen=True)
class Reach:
    """One reach: where, and what, in words a student reads."""

    file: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what}"


def suite_module(name: str, own: set[str]) -> bool:
    """Whether importing ``name`` imports the suite (its own module of that name is the submission's)."""
    top = name.split(".")[0]
    return top == SUITE_PACKAGE or (top in SUITE_FOLDERS and top not in own)


def reaches(tree: ast.Module, file: str, own: set[str] = frozenset()) -> list[Reach]:
    """Every reach into the grader in ``tree`` (the file ``file``), in line order."""
    found: list[Reach] = []
    imported = _imported_names(tree)  # local name -> the dotted name it is bound to
    importlib_names = {name for name, dotted in imported.items() if dotted == "importlib"}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found += _import_reaches(node, file, own)
        elif isinstance(node, ast.Name) and node.id == "__builtins__":
            found.append(Reach(file, line, "uses __builtins__"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in HIDDEN_CODE and node.func.id not in imported:
                found.append(Reach(file, line, f"calls {node.func.id}()"))
            elif node.func.id in ("setattr", "delattr") and node.args and _dotted(node.args[0], imported):
                found.append(Reach(file, line, f"{node.func.id}() on {_dotted(node.args[0], imported)}, an imported module or object"))
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node, imported)
            if dotted == "sys.modules":
                found.append(Reach(file, line, "uses sys.modules"))
            elif isinstance(node.value, ast.Name) and node.value.id in importlib_names and node.attr != "metadata":
                found.append(Reach(file, line, f"uses importlib.{node.attr}"))
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in _flattened(targets):
                written = _written(target, imported)
                if written and not written.startswith(SETTINGS):
                    verb = "deletes" if isinstance(node, ast.Delete) else "writes"
                    found.append(Reach(file, line, f"{verb} {written}, on an imported module or object"))
    return sorted(set(found), key=lambda r: (r.line, r.what))


def _import_reaches(node: ast.Import | ast.ImportFrom, file: str, own: set[str]) -> list[Reach]:
    if isinstance(node, ast.ImportFrom) and node.level:
        return []  # the submission's own package
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    found = []
    for name in names:
        top = name.split(".")[0]
        if suite_module(name, own):
            found.append(Reach(file, node.lineno, f"imports the suite's module {name}"))
        elif top in MEMORY_MODULES:
            found.append(Reach(file, node.lineno, f"imports {name}"))
        elif name == "sys" and isinstance(node, ast.ImportFrom) and any(a.name == "modules" for a in node.names):
            found.append(Reach(file, node.lineno, "imports sys.modules"))
        elif top == "importlib" and name != "importlib" and not name.startswith("importlib.metadata"):
            found.append(Reach(file, node.lineno, f"imports {name}"))
        elif name == "importlib" and isinstance(node, ast.ImportFrom) and any(a.name != "metadata" for a in node.names):
            found.append(Reach(file, node.lineno, f"imports {', '.join(a.name for a in node.names)} from importlib"))
    return found


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """Every name an import binds anywhere in ``tree``, with the dotted name it stands for."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    names[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                if alias.name != "*":
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, imported: dict[str, str]) -> str | None:
    """``a.b.c`` as the dotted name it stands for, when ``a`` is bound by an import; else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in imported:
        return ".".join([imported[node.id], *reversed(parts)])
    return None


def _written(target: ast.AST, imported: dict[str, str]) -> str | None:
    """What an assignment to ``target`` changes outside the submission: an attribute of an imported
    module or object, or an item of its ``__dict__``."""
    if isinstance(target, ast.Attribute):
        return _dotted(target, imported)
    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute) and target.value.attr == "__dict__":
        owner = _dotted(target.value, imported)
        return f"an item of {owner}" if owner else None
    return None


def _flattened(targets: list[ast.AST]) -> list[ast.AST]:
    out = []
    for target in targets:
        if isinstance(target, (ast.Tuple, ast.List)):
            out += _flattened(list(target.elts))
        else:
            out.append(target)
    return out
