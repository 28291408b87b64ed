"""Which files are the submission's own, found from --impl (and CS336_SUBMISSION) without importing
any of it: the grading process never runs the code under test, so the files are located on disk as
Python would find them, and followed through their imports only while those stay inside the
submission's folder. Packages it imports from elsewhere (torch, the course's cs336_basics, the suite)
are not its own: a reach into the suite is reported where it is imported, never followed."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

SUITE_PACKAGE = "parallelism_conformance"
CS336_ADAPTER = f"{SUITE_PACKAGE}.adapters.cs336"
CS336_VARIABLE = "CS336_SUBMISSION"  # adapters/cs336.py: SUBMISSION_VARIABLE (not imported: it imports torch)
# the suite's top-level folders, importable by these names where a checkout is on the path
SUITE_FOLDERS = ("harness", "reference", "impls", "adapters", "conformance")
NOT_SUBMISSIONS = (SUITE_PACKAGE, "torch", *SUITE_FOLDERS)  # an --impl of the suite's own or torch's: nothing to read
MAX_FILES = 500
MAX_BYTES = 4 << 20  # a file larger than this is not read (and said so)


@dataclass
class Submission:
    """The submission's own files, parsed. ``entry`` is the module the ranks load (its top-level
    names are what the contract calls; None for a CS336 repository, whose entry points are mapped);
    ``unread`` says which files could not be read, and why."""

    root: Path | None = None
    entry: Path | None = None
    trees: dict[Path, ast.Module] = field(default_factory=dict)
    unread: list[str] = field(default_factory=list)

    def shown(self, path: Path) -> str:
        """A file as a report names it: relative to the submission's folder (never a staging path)."""
        try:
            return str(path.relative_to(self.root)) if self.root else path.name
        except ValueError:
            return path.name

    def own_module_names(self) -> set[str]:
        """The top-level module names the submission's folder defines (its own ``reference.py``
        shadows the suite's folder of that name: importing it is no reach)."""
        if self.root is None or not self.root.is_dir():
            return set()
        return {p.stem for p in self.root.glob("*.py")} | {p.name for p in self.root.iterdir() if p.is_dir()}


def locate(impl: str, env: dict[str, str], cwd: str) -> Submission:
    """The submission ``impl`` (--impl, as the ranks' loader reads it: harness/rank/loader.py) names,
    read: a .py path from ``cwd``, a module name found on ``cwd`` and sys.path's folders, or a CS336
    repository through the suite's adapter. The suite's own modules and torch's are no submission."""
    if impl.endswith(".py") or os.sep in impl:
        path = Path(os.path.abspath(os.path.join(cwd, impl)))
        return _read(path.parent, path, [path.parent])
    if impl == CS336_ADAPTER:
        where = env.get(CS336_VARIABLE)
        if not where:
            return Submission()
        where = Path(os.path.abspath(where))
        entry = where if where.is_file() else where / "tests" / "adapters.py"
        root = entry.parent.parent
        package = sorted((root / "cs336_systems").rglob("*.py"))[:MAX_FILES]  # the student's package, as the precheck compiles it
        submission = _read(root, entry, [root, entry.parent], package)
        submission.entry = None  # its names are the handout's, mapped by the adapter
        return submission
    if impl.split(".")[0] in NOT_SUBMISSIONS:
        return Submission()
    import sys

    for folder in [cwd, *(p for p in sys.path if p and "site-packages" not in p)]:
        found = _resolve(impl.split("."), Path(folder))
        if found:
            root = Path(folder) / impl.split(".")[0]
            return _read(root if root.is_dir() else Path(folder), found[-1], [Path(folder)])
    return Submission()


def _read(root: Path, entry: Path, bases: list[Path], also: list[Path] = ()) -> Submission:
    """``entry`` (and ``also``) and every file of ``root`` they import, transitively, each parsed once."""
    submission = Submission(root=root, entry=entry)
    todo = [entry, *also]
    while todo and len(submission.trees) < MAX_FILES:
        path = todo.pop(0)
        if path in submission.trees or not _inside(path, root):
            continue
        tree = _parse(path, submission)
        if tree is None:
            continue
        submission.trees[path] = tree
        todo.extend(_imported_files(tree, path, bases))
    return submission


def _parse(path: Path, submission: Submission) -> ast.Module | None:
    try:
        if path.stat().st_size > MAX_BYTES:
            submission.unread.append(f"{submission.shown(path)} (over {MAX_BYTES >> 20} MiB)")
            return None
        return ast.parse(path.read_bytes(), str(path))
    except (OSError, SyntaxError, ValueError) as error:  # the precheck or the ranks' loader says it to the student
        submission.unread.append(f"{submission.shown(path)} ({type(error).__name__})")
        return None


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except (ValueError, OSError):
        return False
    return True


def _imported_files(tree: ast.Module, path: Path, bases: list[Path]) -> list[Path]:
    """The files ``tree`` imports from ``bases`` (absolute imports) or its own package (relative),
    never a module of the suite's (that is a reach, reported, not followed)."""
    found: list[Path] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in NOT_SUBMISSIONS:
                    found += _first(alias.name.split("."), bases)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
                parts, where = (node.module.split(".") if node.module else []), [base]
            elif node.module and node.module.split(".")[0] not in NOT_SUBMISSIONS:
                parts, where = node.module.split("."), bases
            else:
                continue
            found += _first(parts, where) if parts else [base / "__init__.py"] * (base / "__init__.py").is_file()
            for alias in node.names:  # a name may be a submodule
                found += [p for p in _first([*parts, alias.name], where) if p.stem == alias.name]
    return found


def _first(parts: list[str], bases: list[Path]) -> list[Path]:
    for base in bases:
        found = _resolve(parts, base)
        if found:
            return found
    return []


def _resolve(parts: list[str], base: Path) -> list[Path]:
    """The files Python would run for ``import a.b.c`` from ``base``: each package's __init__.py and
    the module's own file (a namespace package has none)."""
    found, here = [], base
    for part in parts:
        if (here / part).is_dir():
            here = here / part
            if (here / "__init__.py").is_file():
                found.append(here / "__init__.py")
        elif (here / f"{part}.py").is_file():
            found.append(here / f"{part}.py")
            break
        else:
            return found if here != base else []
    return found
