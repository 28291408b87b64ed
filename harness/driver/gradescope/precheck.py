"""The submission checked before any rank starts: is the expected file there, does it compile, does
it import? A submission that fails here gets one failed test that names what was expected and what
was found, instead of every test of the suite failing with the same import error, or a platform
error with nothing shown to the student.

The file and syntax checks only read and compile (``compile`` runs nothing). The import check runs
the submission's top level, which is code under test, so it runs as a contained rank would: in a
forked child that enters a fresh sandbox first (harness/rank/containment.py), whose processes are
swept afterwards, and whose only way back is a bounded message through a pipe."""

from __future__ import annotations

import difflib
import os
import select
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from parallelism_conformance.harness.driver.gradescope.config import AutograderConfig
from parallelism_conformance.harness.rank import containment

IMPORT_TIMEOUT_S = 120.0  # importing torch and the submission on 0.5 vCPU takes about 10 s
MESSAGE_LIMIT = 6000  # bytes of the child's answer kept
_IGNORED_DIRS = {"__MACOSX", "__pycache__", ".git", ".venv", "venv", "node_modules"}


@dataclass(frozen=True)
class Problem:
    """Why the submission cannot be graded, in the words the student sees."""

    name: str  # the failed test's name
    message: str


@dataclass(frozen=True)
class Found:
    """The submission as the suite grades it: ``--impl`` and the environment it needs."""

    impl: str
    env: dict[str, str]
    note: str = ""  # said in the run's output (e.g. the file was found in a subfolder)


def files_of(root: Path, limit: int = 2000) -> list[Path]:
    """The submission's files, relative to ``root``, without hidden, cache and archive folders."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _IGNORED_DIRS)
        for name in sorted(names):
            found.append(Path(folder, name).relative_to(root))
            if len(found) >= limit:
                return found
    return found


def _listing(files: list[Path], limit: int = 12) -> str:
    if not files:
        return "the submission is empty"
    shown = ", ".join(str(f) for f in files[:limit])
    return f"the submission holds {shown}" + (f" and {len(files) - limit} more" if len(files) > limit else "")


def locate(submission: Path, config: AutograderConfig) -> Found | Problem:
    """Where the expected file (or the CS336 repository) is in ``submission``."""
    files = files_of(submission)
    if config.is_cs336:
        return _locate_cs336(submission, files)
    wanted = Path(config.expects)
    if (submission / wanted).is_file():
        return Found(str(submission / wanted), {})
    same_name = sorted((f for f in files if f.name == wanted.name), key=lambda f: (len(f.parts), str(f)))
    if same_name and (len(same_name) == 1 or len(same_name[0].parts) < len(same_name[1].parts)):
        return Found(str(submission / same_name[0]), {}, f"graded {same_name[0]} (expected at {wanted})")
    if same_name:
        return Problem(
            "The submission has the expected file",
            f"expected one {wanted}; found several at the same depth: {', '.join(map(str, same_name))}. Submit only the one to grade.",
        )
    python_files = [str(f) for f in files if f.suffix == ".py"]
    close = difflib.get_close_matches(str(wanted), python_files, n=1, cutoff=0.5) or (python_files if len(python_files) == 1 else [])
    hint = f" Did you mean {close[0]}? Rename it to {wanted.name}." if close else ""
    return Problem("The submission has the expected file", f"expected {wanted} at the submission's root; {_listing(files)}.{hint}")


def _locate_cs336(submission: Path, files: list[Path]) -> Found | Problem:
    handout = Path("tests", "adapters.py")
    candidates = sorted(
        (f.parents[1] for f in files if f.parts[-2:] == handout.parts and len(f.parts) <= 4), key=lambda p: (len(p.parts), str(p))
    )
    if not candidates:
        return Problem(
            "The submission has the expected file",
            f"expected a CS336 assignment 2 repository, with {handout} at its root (the handout's layout: "
            f"the functions the suite calls are in it); {_listing(files)}.",
        )
    root = submission / candidates[0]
    from parallelism_conformance.adapters.cs336_layers import layers_module  # parses the submission's tests; runs none of it

    layers, found_in = layers_module(str(root))
    notes = [f"graded the repository in {candidates[0]}"] if candidates[0] != Path(".") else []
    notes.append(f"its FSDP is graded on the layers of {layers} ({found_in})")
    return Found("parallelism_conformance.adapters.cs336", {"CS336_SUBMISSION": str(root)}, "; ".join(notes))


def syntax_problem(found: Found) -> Problem | None:
    """The first file of the submission that does not compile, with its line (nothing is run)."""
    if found.impl.endswith(".py"):
        paths = [Path(found.impl)]
    else:
        root = Path(found.env["CS336_SUBMISSION"])
        paths = [root / "tests" / "adapters.py", *sorted(root.glob("cs336_systems/**/*.py"))[:500]]
    for path in paths:
        try:
            compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
        except SyntaxError as error:
            where = f"{path.name}, line {error.lineno}" + (f", column {error.offset}" if error.offset else "")
            text = f"\n    {error.text.rstrip()}" if error.text else ""
            return Problem("The submission compiles", f"{where}: {error.msg}{text}")
        except (OSError, ValueError) as error:  # unreadable, or a null byte in the source
            return Problem("The submission compiles", f"{path.name} cannot be compiled: {error}")
    return None


@dataclass(frozen=True)
class Imported:
    """What importing the submission as a rank would showed: the problem (None: it imports), and the
    anonymous memory the import added to a process that had the ranks' preloaded modules, read by
    the driver from the child's /proc/<pid>/status (None where it could not be read)."""

    problem: Problem | None
    import_bytes: int | None = None


def import_problem(found: Found, *, contain: bool, timeout_s: float = IMPORT_TIMEOUT_S) -> Problem | None:
    """Import the submission as a rank would (contained when ``contain``) and say what it raised.
    None when it imports, and also when containment itself cannot be set up here: that is the
    grader's problem, not the submission's, and the suite's own check refuses to grade then."""
    return check_import(found, contain=contain, timeout_s=timeout_s).problem


def check_import(found: Found, *, contain: bool, timeout_s: float = IMPORT_TIMEOUT_S) -> Imported:
    """:func:`import_problem`, and what the import costs a rank in memory. The child first imports
    what every rank has before the implementation (harness/rank/preload.py) and waits; the
    driver reads its resident anonymous memory, lets it import the submission, and reads it again
    once the answer is in. The child reports nothing about memory itself: a submission that shrank
    the figure would only get more ranks alive at once than the container holds, and the OOM
    killer takes ranks before the driver (harness/rank/loop.py)."""
    sandbox = containment.new_sandbox() if contain else None
    read_end, write_end = os.pipe()
    ready_read, ready_write = os.pipe()  # child -> driver: the preload is imported
    go_read, go_write = os.pipe()  # driver -> child: one byte to import; closed: exit
    pid = os.fork()
    if pid == 0:  # the child: never returns into the driver's code
        for fd in (read_end, ready_read, go_write):
            os.close(fd)
        _import_in_child(found, sandbox, write_end, ready_write, go_read)
    for fd in (write_end, ready_write, go_read):
        os.close(fd)
    deadline = time.monotonic() + timeout_s
    before = None
    if _wait_readable(ready_read, deadline) and os.read(ready_read, 1) == b"B":
        before = _anonymous_bytes(pid)
    os.close(ready_read)
    try:
        os.write(go_write, b"G")
    except OSError:  # the child is gone: its answer (or none) says why
        pass
    answer, timed_out = _read_bounded(read_end, max(0.0, deadline - time.monotonic()))
    after = _anonymous_bytes(pid)
    os.close(go_write)
    _reap(pid, kill=timed_out)
    if sandbox is not None:
        containment.sweep(sandbox)
    if timed_out:
        return Imported(
            Problem(
                "The submission imports",
                f"importing {_shown(found)} did not finish within {timeout_s:g} s (code at the top level of a module runs when it is imported)",
            )
        )
    kind, message = answer[:1], answer[1:].decode(errors="replace")
    if kind == b"I":
        return Imported(Problem("The submission imports", f"importing {_shown(found)} raised:\n{message}"))
    if kind == b"M":  # a package the image lacks, or a module the submission lacks: said both ways
        return Imported(
            Problem(
                "The submission imports",
                f"importing {_shown(found)} raised:\n{message}.\n\n"
                "If it is a package from the package index, the autograder's image lacks it: course "
                "staff add it to the autograder's packages (scripts/autograder --requirements, or "
                "autograder.json's requirements) and rebuild the image. If it is a module of your "
                "own, it is missing from your submission.",
            )
        )
    if kind not in (b"K", b"C"):  # its code closed the pipe, or ended or stopped the child, before the answer
        return Imported(
            Problem(
                "The submission imports",
                f"importing {_shown(found)} gave no answer: the process "
                "that imported it closed the autograder's pipe, stopped or ended first (code at the "
                "top level of a module runs when it is imported)",
            )
        )
    cost = max(0, after - before) if before is not None and after is not None else None
    return Imported(None, cost)  # b"K": imported; b"C": containment failed (the suite refuses and says why)


def _wait_readable(fd: int, deadline: float) -> bool:
    left = deadline - time.monotonic()
    return left > 0 and bool(select.select([fd], [], [], left)[0])


def _anonymous_bytes(pid: int) -> int | None:
    """The process's resident anonymous memory (RssAnon of /proc/<pid>/status, readable by every
    user: no ptrace access needed, so root without CAP_SYS_PTRACE reads a contained child's)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError):
        return None
    return None


def _reap(pid: int, *, kill: bool, patience_s: float = 10.0) -> None:
    """Wait for the child, boundedly: killed when asked, when it stops itself, or when it has not
    exited ``patience_s`` after its pipes closed."""
    if kill:
        os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + patience_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG | os.WUNTRACED)
        if done and not os.WIFSTOPPED(status):
            return
        if done or time.monotonic() > end:  # stopped, or still running past its time
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.02)


def _shown(found: Found) -> str:
    return Path(found.impl).name if found.impl.endswith(".py") else "the repository's tests/adapters.py"


def _import_in_child(found: Found, sandbox, write_end: int, ready_write: int, go_read: int) -> None:
    kind, message = b"K", ""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)  # what the submission prints at import is not the report's business
        os.dup2(null, 2)
        try:
            if sandbox is not None:
                # the driver's pipes to the platform are root's: only this child's own three stay
                containment.close_inherited({write_end, ready_write, go_read})
                containment.enter(sandbox)
        except BaseException as error:  # noqa: BLE001 - any failure to contain is reported, never run past
            kind, message = b"C", repr(error)
        else:
            os.environ.update(found.env)
            try:
                import importlib

                from parallelism_conformance.harness.rank.preload import PRELOAD  # what a rank has before the implementation

                for name in PRELOAD:
                    importlib.import_module(name)
                os.write(ready_write, b"B")
                os.read(go_read, 1)
                from parallelism_conformance.harness.rank.loader import MissingDependency, load_implementation

                try:
                    load_implementation(found.impl)
                except MissingDependency as error:
                    kind, message = b"M", str(error)
            except BaseException:  # noqa: BLE001 - whatever the submission raised is the answer
                kind, message = b"I", _student_traceback()
        os.write(write_end, kind + message.encode(errors="replace")[:MESSAGE_LIMIT])
        os.close(write_end)
        os.read(go_read, 1)  # until the driver has read this process's memory and closed its end
    finally:
        os._exit(0)


def _student_traceback() -> str:
    """The traceback from the submission's first frame on (the loader's frames say nothing to a student)."""
    lines = traceback.format_exc().splitlines()
    start = next((i for i, line in enumerate(lines) if "harness/rank/loader.py" in line or "importlib" in line), 0)
    body = [line for line in lines[start:] if "importlib" not in line and "harness/rank/loader.py" not in line]
    return "\n".join(body[-40:])


def _read_bounded(fd: int, timeout_s: float) -> tuple[bytes, bool]:
    """What the child writes until it closes the pipe, at most MESSAGE_LIMIT + 1 bytes kept."""
    chunks, size, deadline = [], 0, time.monotonic() + timeout_s
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                return b"".join(chunks), True
            chunk = pipe.read(65536)
            if not chunk:
                return b"".join(chunks), False
            if size <= MESSAGE_LIMIT:
                chunks.append(chunk)
                size += len(chunk)
