"""The suite's bundled implementations (impls/) and adapters (adapters/) as the driver reads them:
from the installed suite's files (never imported), each module's names, and every function's body
normalised so that a copy is known whatever it was renamed to.

A body is normalised by dropping its docstring and annotations and renaming every name it binds
(its arguments, its locals, the functions it defines) by order of first appearance: what is left
is the code's shape with the names of what it calls (``dist.send``, ``torch.zeros``) and its
constants. A copy with its function and variables renamed dumps the same; code written afresh,
even to the same design, does not. Bodies of fewer than MIN_NODES nodes are not compared: a
two-line helper is written alike by everyone."""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import parallelism_conformance
from parallelism_conformance.harness.driver.submission.files import SUITE_PACKAGE

BUNDLED = ("impls", "adapters")
MIN_NODES = 60  # the smallest body compared (ast nodes after normalising); the bundled ones of interest have 100 or more


@dataclass(frozen=True)
class Original:
    """A bundled function: its file (``impls/collectives.py``) and its dotted place in it."""

    file: str
    qualname: str

    @property
    def top(self) -> str:
        return self.qualname.split(".")[0]


@dataclass
class BundledIndex:
    """``modules``: dotted module (``impls.collectives``, ``impls`` for the package) -> (its file,
    the names it binds at the top); ``bodies``: normalised body -> the bundled functions with it."""

    modules: dict[str, tuple[str, frozenset[str]]] = field(default_factory=dict)
    bodies: dict[str, list[Original]] = field(default_factory=dict)

    def module(self, dotted: str) -> str | None:
        """The bundled module ``dotted`` names (``parallelism_conformance.impls.x``, or ``impls.x``
        from a checkout), as its key here; None when it is not one."""
        name = dotted.removeprefix(SUITE_PACKAGE + ".")
        return name if name in self.modules else None


def folders() -> dict[str, Path]:
    """impls/ and adapters/ of the suite that is running (installed: inside the package; a checkout:
    at its root, which the package's search path ends with)."""
    found = {}
    for entry in parallelism_conformance.__path__:
        for name in BUNDLED:
            if name not in found and (Path(entry) / name / "__init__.py").is_file():
                found[name] = Path(entry) / name
    return found


@lru_cache(maxsize=1)
def index() -> BundledIndex:
    """The bundled implementations, read once a process (about 0.3 s)."""
    result = BundledIndex()
    for package, folder in folders().items():
        trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(folder.glob("*.py"))}
        for path, tree in trees.items():
            dotted = package if path.stem == "__init__" else f"{package}.{path.stem}"
            file = f"{package}/{path.name}"
            result.modules[dotted] = (file, frozenset(_top_names(tree, folder, trees)))
            for qualname, function in functions(tree):
                body = normalised(function)
                if body is not None:
                    result.bodies.setdefault(body, []).append(Original(file, qualname))
    return result


def _top_names(tree: ast.Module, folder: Path, trees: dict[Path, ast.Module], depth: int = 0) -> set[str]:
    """The names a module binds at its top level, a relative ``import *`` followed into its sibling."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*" and isinstance(node, ast.ImportFrom) and node.level == 1 and depth < 3:
                    sibling = trees.get(folder / f"{node.module}.py")
                    names |= {n for n in _top_names(sibling, folder, trees, depth + 1) if not n.startswith("_")} if sibling else set()
                elif alias.name != "*":
                    names.add(alias.asname or alias.name.split(".")[0])
    return names


def functions(tree: ast.AST, prefix: str = ""):
    """Every function of ``tree``, methods and nested ones too, with its dotted place."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def normalised(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The body of ``function`` as a canonical string (the module's docstring explains), or None
    when it is too small to compare."""
    function = copy.deepcopy(function)
    body = function.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(getattr(body[0], "value", None), ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    arguments = function.args
    bound = [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg] if a]
    renamer = _Renamer(bound, body)
    shape = ast.Module(body=[renamer.visit(statement) for statement in body], type_ignores=[])
    size = sum(1 for _ in ast.walk(shape))
    if size < MIN_NODES:
        return None
    return f"{len(bound)}|" + ast.dump(shape, annotate_fields=False, include_attributes=False)


class _Renamer(ast.NodeTransformer):
    """Renames every name a body binds (and its arguments) to v0, v1, ... by first appearance; drops
    annotations and nested docstrings."""

    def __init__(self, arguments: list[str], body: list[ast.stmt]):
        self.names: dict[str, str] = {}
        for name in arguments:
            self._name(name)
        self.local = set(arguments)
        for statement in body:
            for node in ast.walk(statement):
                if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                    self.local.add(node.id)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.local.add(node.name)
                elif isinstance(node, ast.arg):
                    self.local.add(node.arg)
                elif isinstance(node, ast.ExceptHandler) and node.name:
                    self.local.add(node.name)

    def _name(self, name: str) -> str:
        return self.names.setdefault(name, f"v{len(self.names)}")

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Name(self._name(node.id), node.ctx) if node.id in self.local else node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        return ast.arg(self._name(node.arg), None)

    def visit_FunctionDef(self, node):
        node.name, node.returns = self._name(node.name), None
        return self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        node.annotation = ast.Constant(None)
        return self.generic_visit(node)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> ast.AST:
        if node.name:
            node.name = self._name(node.name)
        return self.generic_visit(node)
