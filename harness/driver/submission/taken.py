"""What a submission takes from the suite's bundled implementations, by capability: the answer the
suite ships (and installs beside every grading run) is not the student's work, so a capability
whose entry points are the bundled ones gets 0, saying why.

A capability is taken when a name it provides (CONTRACT.md; harness/driver/capabilities.py) is, in
the module the ranks load:

* imported from impls/ or adapters/ (by name, by ``import *``, or through a module object used
  whole) and not defined by the submission itself;
* defined by the submission as a wrapper of the bundled one of the same name (its definition, or
  a helper of the module it calls, refers to it: ``def all_reduce(*a): return impls.all_reduce(*a)``);
* a copy of a bundled function (bundled.py: the same normalised body, whatever its names).

In the submission's other files (helpers it imports; a CS336 repository's) every bundled name is
counted against the capabilities that provide it, or whose files hold it. A bundled helper called
from the submission's own definition of a name is an import of the suite: a reach, flagged
(reaches.py), not a capability taken.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from parallelism_conformance.harness.driver import capabilities
from parallelism_conformance.harness.driver.submission.bundled import BundledIndex, functions, normalised
from parallelism_conformance.harness.driver.submission.files import Submission
from parallelism_conformance.harness.driver.submission.reaches import _imported_names

PROVIDED = frozenset(capabilities.provided_names())
ALL = None  # a bundled module used whole: every name it has


@dataclass(frozen=True)
class Taken:
    """Where the submission takes bundled code, what, and the capabilities that costs."""

    file: str
    line: int
    what: str
    capabilities: frozenset[str]

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what}"


def capabilities_of(names, file: str | None = None) -> frozenset[str]:
    """The capabilities that provide one of ``names``, or (none providing one) whose files hold ``file``."""
    named = {c.name for c in capabilities.CAPABILITIES if set(c.provides) & set(names)}
    if named or file is None:
        return frozenset(named)
    return frozenset(c.name for c in capabilities.CAPABILITIES if file in c.files)


def taken(submission: Submission, index: BundledIndex) -> list[Taken]:
    """Every take of bundled code in the submission, the entry module's by its names, the rest whole."""
    found: list[Taken] = []
    for path, tree in submission.trees.items():
        shown = submission.shown(path)
        if path == submission.entry:
            found += _entry_takes(tree, shown, index)
        else:
            found += _file_takes(tree, shown, index)
        found += _copies(tree, shown, index, entry=path == submission.entry)
    return [t for t in found if t.capabilities]


class _Bindings:
    """The names of one file bound to bundled code: local name -> (bundled module, its name or ALL)."""

    def __init__(self, tree: ast.Module, index: BundledIndex):
        self.index, self.names, self.star, self.lines = index, {}, {}, {}
        self.imported = _imported_names(tree)
        for local, dotted in self.imported.items():
            where = self.resolve(dotted)
            if where is not None:
                self.names[local] = where
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    self.lines.setdefault(alias.asname or alias.name.split(".")[0], node.lineno)
            if isinstance(node, ast.ImportFrom) and not node.level and node.module and any(a.name == "*" for a in node.names):
                module = index.module(node.module)
                if module is not None:
                    for name in index.modules[module][1]:
                        if not name.startswith("_"):
                            self.star.setdefault(name, (module, name))
                            self.lines.setdefault(name, node.lineno)

    def resolve(self, dotted: str) -> tuple[str, str | None] | None:
        """``dotted`` as (bundled module, name in it or ALL), where it names bundled code."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = self.index.module(".".join(parts[:cut]))
            if module is not None:
                return module, (parts[cut] if cut < len(parts) else ALL)
        return None

    def refs(self, node: ast.AST, defined: set[str]) -> set[tuple[str, str | None]]:
        """The bundled names ``node`` refers to (a name of the star import counts unless ``defined``):
        ``b.x`` as x of b's module, a name bound to a module used bare as the whole module."""
        found, roots = set(), set()
        for child in ast.walk(node):
            if isinstance(child, ast.Attribute):  # only the outermost of a chain a.b.c is read
                roots.add(id(child.value))
        for child in ast.walk(node):
            if isinstance(child, ast.Attribute) and id(child) not in roots:
                dotted = _chain(child)
                root = dotted.split(".")[0] if dotted else None
                if root in self.imported:
                    where = self.resolve(".".join([self.imported[root], *dotted.split(".")[1:]]))
                    found |= {where} if where else set()
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Load) and id(child) not in roots:
                if child.id in self.names:
                    found.add(self.names[child.id])
                elif child.id in self.star and child.id not in defined:
                    found.add(self.star[child.id])
        return found

    def names_of(self, module: str, name: str | None) -> frozenset[str]:
        return self.index.modules[module][1] if name is ALL else frozenset([name])


def _chain(node: ast.Attribute) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _top_definitions(tree: ast.Module) -> dict[str, list[ast.AST]]:
    """The module's own top-level bindings (not imports): name -> the statements that bind it."""
    defined: dict[str, list[ast.AST]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.setdefault(node.name, []).append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in (n.id for n in ast.walk(target) if isinstance(n, ast.Name)):
                    defined.setdefault(name, []).append(node)
    return defined


def _entry_takes(tree: ast.Module, file: str, index: BundledIndex) -> list[Taken]:
    bindings = _Bindings(tree, index)
    defined = _top_definitions(tree)
    # what each top-level name refers to of the bundled code, through the module's own helpers
    refs = {name: set().union(*(bindings.refs(n, set(defined)) for n in nodes)) for name, nodes in defined.items()}
    uses = {
        name: {u for n in nodes for u in (c.id for c in ast.walk(n) if isinstance(c, ast.Name)) if u in defined}
        for name, nodes in defined.items()
    }
    changed = True
    while changed:
        changed = False
        for name in refs:
            grown = refs[name].union(*(refs[u] for u in uses[name]))
            if grown != refs[name]:
                refs[name], changed = grown, True
    whole = {m for m, name in bindings.refs(tree, set(defined)) if name is ALL}  # a module used whole, anywhere
    found = []
    for name in sorted(PROVIDED):
        if name in defined:
            if any(n == name or (n is ALL and name in index.modules[m][1]) for m, n in refs[name]):
                line = defined[name][0].lineno
                found.append(Taken(file, line, f"{name} wraps the bundled {name}", capabilities_of([name])))
            continue
        source = bindings.names.get(name) or bindings.star.get(name)
        if source is None:
            source = next(((m, name) for m in whole if name in index.modules[m][1]), None)
        if source is not None:
            line = bindings.lines.get(name, 1)
            found.append(Taken(file, line, f"{name} is the bundled one ({_dotted(source[0])})", capabilities_of([name])))
    return _merged(found)


def _file_takes(tree: ast.Module, file: str, index: BundledIndex) -> list[Taken]:
    bindings = _Bindings(tree, index)
    used = bindings.refs(tree, set(_top_definitions(tree))) | set(bindings.star.values())
    found = []
    for module, name in sorted(used, key=lambda u: (u[0], u[1] or "")):
        names = bindings.names_of(module, name)
        what = f"uses {'the whole of' if name is ALL else name + ' of'} {_dotted(module)}"
        found.append(Taken(file, bindings.lines.get(name or "", 1), what, capabilities_of(names, index.modules[module][0])))
    return found


def _copies(tree: ast.Module, file: str, index: BundledIndex, entry: bool) -> list[Taken]:
    found = []
    for qualname, function in functions(tree):
        body = normalised(function)
        for original in index.bodies.get(body, ()) if body else ():
            own = qualname.split(".")[0]
            chosen = capabilities_of([own]) if entry and own in PROVIDED else frozenset()
            chosen = chosen or capabilities_of([original.top], original.file)
            found.append(Taken(file, function.lineno, f"{qualname} is a copy of {original.file}: {original.qualname}", chosen))
    return found


def _merged(found: list[Taken]) -> list[Taken]:
    """Takes of one file and kind said once: ``imports a, b, c (12 names) ...``."""
    by_source: dict[tuple[str, str], list[Taken]] = {}
    for take in found:
        by_source.setdefault((take.what.split(" ", 1)[1], str(take.line)), []).append(take)
    merged = []
    for (rest, _), group in by_source.items():
        names = [t.what.split(" ", 1)[0] for t in group]
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        if len(names) > 1:
            rest = rest.replace("is the bundled one", "are the bundled ones")
        merged.append(Taken(group[0].file, group[0].line, f"{shown} {rest}", frozenset().union(*(t.capabilities for t in group))))
    return merged


def _dotted(module: str) -> str:
    return f"parallelism_conformance.{module}, the suite's bundled {'adapter' if module.startswith('adapters') else 'implementation'}"


def describe(takes: list[Taken]) -> str:
    return "; ".join(map(str, takes))
