"""Many short pytest runs without paying for Python and torch each time.

The mutation runner (harness/driver/mutation.py) starts about 170 pytest runs; a mutant's run takes
5-10 s, of which a fresh interpreter importing torch and pytest is about 1.2 s on this machine
(measured: one targeted mutant run, 4.0 s as a subprocess against 2.8 s forked from an interpreter
that had imported them). ``WarmPytest`` starts one *template* process
(``python -m parallelism_conformance.harness.driver.warm_pytest``) that imports torch and pytest once and then
forks one fresh child per run; the child calls ``pytest.main`` with the run's arguments, its stdout
and stderr going to a file, and exits with pytest's exit code.

Every run is still its own process, as a subprocess run is: its own pytest session and its own
worlds of ranks. The template imports no module of this repository and no pytest plugin
(hypothesis is one), so pytest still rewrites the assertions of the plugins and the tests in each
child (a module imported before pytest starts cannot be rewritten: pytest warns). The template is
single-threaded by design (forking a process with threads of its own can leave a lock held in the
child); torch's import starts one native thread, the state the harness's forkserver already forks
every rank from.

Given ``forkserver_preload`` (harness/rank/preload.py), the template also starts the one
multiprocessing forkserver that every run's ranks are forked from. A run's own forkserver was a
fresh interpreter importing torch and torch._dynamo before its first world could start: about
2.4 s of CPU per run, 170 times. A rank is forked with its driver's sys.path and working directory
(multiprocessing sends them) and environment (harness.rank.loop.RankConfig.environment), so a
shared forkserver changes nothing a rank sees. Ranks then outlive a driver killed by SIGKILL by at
most their watchdog's half second (harness/rank/loop.py), where with a forkserver of the run's own
the kernel killed them at once. A run whose inherited forkserver is gone starts its own.

Protocol (one JSON object per line): the driver writes ``{"id", "args", "cwd", "env", "output"}`` to the
template's stdin; the template answers ``{"id", "pid"}`` when it has forked that run's child and
``{"id", "code"}`` when the child has exited (a child killed by a signal answers -signal). The template
sleeps until a request or a child's exit wakes it (SIGCHLD through a wakeup pipe), never polls. If
the template dies or cannot start, every run not yet answered, and every later one, runs as a plain
subprocess instead: slower, never lost.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

# hypothesis (45 ms) is a pytest plugin: left out. torch._dynamo: torch imports it on the first call
# of a function it decorated (an optimizer's constructor, in the reference's training): 0.9 s per run
WARM_IMPORTS = ("torch", "torch.distributed", "torch._dynamo", "pytest")


class _Run:
    """One submitted run: its answer, where its output goes, and its child's pid once forked."""

    def __init__(self, output_path: str):
        self.output_path = output_path
        self.code: Future = Future()
        self.pid: int | None = None
        self.forked = threading.Event()  # its pid is known, or the template is gone
        self.forked_at = 0.0

    def started(self, pid: int) -> None:
        self.pid, self.forked_at = pid, time.monotonic()
        self.forked.set()


class WarmPytest:
    """Driver side: ``run(args, cwd)`` -> (exit code, output, seconds), callable from many threads.

    ``forkserver_preload``: the modules of the forkserver the template starts for every run's ranks
    (harness/rank/preload.py); empty: each run starts its own, as a plain pytest would."""

    def __init__(self, python: str = sys.executable, forkserver_preload: Sequence[str] = ()):
        self._python = python
        self._lock = threading.Lock()
        self._pending: dict[int, _Run] = {}
        self._next_id = 0
        self._template: subprocess.Popen | None = None
        self._broken = ""
        try:
            here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            self._template = subprocess.Popen(
                [python, "-m", "parallelism_conformance.harness.driver.warm_pytest", ",".join(forkserver_preload)],
                cwd=here,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
            threading.Thread(target=self._read_answers, name="warm-pytest-answers", daemon=True).start()
        except OSError as error:
            self._broken = f"the template did not start: {error}"

    def run(self, args: list[str], cwd: str, env: dict[str, str] | None = None, timeout_s: float | None = None) -> tuple[int, str, float]:
        """``env``: variables the run sees on top of this process's environment. ``timeout_s``: the
        run is killed past it (its output then says so), as subprocess.run's timeout would end it."""
        started = time.monotonic()
        handle, output_path = tempfile.mkstemp(prefix="warm-pytest-", suffix=".log")
        os.close(handle)
        try:
            run = self._submit(args, cwd, output_path, env or {})
            code, late = self._wait(run, timeout_s) if run is not None else (None, "")
            if code is None:  # no template: the same run as a plain subprocess
                return self._run_plainly(args, cwd, env, timeout_s, started)
            with open(output_path, errors="replace") as output:
                text = output.read()
            if code < 0:
                text += f"\n(the pytest run was killed by signal {-code}{late})\n"
            return code, text, time.monotonic() - started
        finally:
            os.unlink(output_path)

    def _wait(self, run: _Run, timeout_s: float | None) -> tuple[int | None, str]:
        """The run's exit code (None: left to a subprocess), killing its child ``timeout_s`` after it
        was forked (a template still importing torch has not started it yet)."""
        if timeout_s is None:
            return run.code.result(), ""
        run.forked.wait()
        try:
            return run.code.result(timeout=max(0.0, run.forked_at + timeout_s - time.monotonic())), ""
        except FutureTimeout:
            with self._lock:
                pid = run.pid
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)  # the template reaps it and answers -9
                except ProcessLookupError:
                    pass
            code = run.code.result()
            return (-signal.SIGKILL if code is None else code), f", past its {timeout_s:g} s timeout"

    def _run_plainly(self, args, cwd, env, timeout_s, started) -> tuple[int, str, float]:
        command = [self._python, "-m", "pytest", *args]
        try:
            done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout_s)
        except subprocess.TimeoutExpired as expired:
            text = "".join(
                part.decode(errors="replace") if isinstance(part, bytes) else part or "" for part in (expired.stdout, expired.stderr)
            )
            return -signal.SIGKILL, text + f"\n(the pytest run was killed past its {timeout_s:g} s timeout)\n", time.monotonic() - started
        return done.returncode, done.stdout + done.stderr, time.monotonic() - started

    def close(self) -> None:
        if self._template is not None and self._template.poll() is None:
            self._template.stdin.close()  # the template exits at end of input, after its children
            try:
                self._template.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._template.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --------------------------------------------------------------------------------- internals
    def _submit(self, args, cwd, output_path, env) -> _Run | None:
        with self._lock:
            if self._broken or self._template is None:
                return None
            run = _Run(output_path)
            run_id = self._next_id
            self._next_id += 1
            self._pending[run_id] = run
            try:
                self._template.stdin.write(json.dumps({"id": run_id, "args": args, "cwd": cwd, "env": env, "output": output_path}) + "\n")
                self._template.stdin.flush()
            except (OSError, ValueError) as error:
                self._fail_all(f"the template stopped reading: {error}")
        return run

    def _read_answers(self) -> None:
        for line in self._template.stdout:
            answer = json.loads(line)
            with self._lock:
                run = self._pending.get(answer["id"])
                if run is not None and "pid" in answer:
                    run.started(answer["pid"])
                    continue
                self._pending.pop(answer["id"], None)
            if run is not None:
                run.code.set_result(answer["code"])
        with self._lock:
            self._fail_all(f"the template exited with code {self._template.wait()}")

    def _fail_all(self, why: str) -> None:
        """Called with the lock held: the runs not answered fall back to subprocesses."""
        self._broken = why
        for run in self._pending.values():
            if not run.code.done():
                run.code.set_result(None)
            run.forked.set()
        self._pending.clear()


# ------------------------------------------------------------------------------------- template
def _child(request: dict) -> None:
    """In the forked child: never returns."""
    code = 3
    try:
        _reuse_forkserver()
        os.chdir(request["cwd"])
        os.environ.update(request.get("env") or {})
        null = os.open(os.devnull, os.O_RDONLY)
        output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(null, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        sys.argv = ["pytest", *request["args"]]
        if request["cwd"] not in sys.path:
            sys.path.insert(0, request["cwd"])  # as `python -m pytest` run there would have it
        import pytest

        code = int(pytest.main(request["args"]))
    except BaseException:  # noqa: BLE001 - whatever happened is the run's output
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # as an interpreter's exit would (multiprocessing ends its children)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _start_forkserver(preload: list[str]) -> None:
    """Start the forkserver every run's ranks are forked from, preloading ``preload`` (in its own
    process: the template itself imports none of them)."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(preload)
    forkserver.ensure_running()


def _reuse_forkserver() -> None:
    """In a child: fork ranks through the template's forkserver. multiprocessing checks a forkserver
    it started with waitpid, which fails in a grandchild, so the check becomes "is that process still
    there"; a forkserver that is gone (or one multiprocessing does not describe as expected) leaves
    this run to start its own, as a fresh interpreter would."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    inherited = getattr(server, "_forkserver_pid", None)
    if inherited is None or not hasattr(server, "_forkserver_address"):
        return
    start_own = server.ensure_running

    def ensure_running():
        if server._forkserver_pid == inherited:
            try:
                os.kill(inherited, 0)
                resource_tracker.ensure_running()
                return
            except OSError:  # gone (the template reaps it): this run's own from now on
                server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
        start_own()

    server.ensure_running = ensure_running


def _template(preload: list[str]) -> None:
    for module in WARM_IMPORTS:
        __import__(module)
    # The imported heap (290,000 objects the collector tracks, measured) moves to the collector's permanent
    # generation: each run's pytest calls gc.collect several times at its end (unraisableexception's
    # gc_collect_harder), 0.35 s of CPU a run scanning objects that never die; frozen ones are
    # skipped, and pages the child never writes stay shared with the template.
    gc.collect()
    gc.freeze()
    if preload:
        _start_forkserver(preload)
    children: dict[int, int] = {}  # pid -> run id
    wakeup, wakeup_write = _child_exits_wake()
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wakeup, selectors.EVENT_READ)
    unread = b""
    reading = True
    while reading or children:
        for key, _ in selector.select():  # a request, or a child's exit
            if key.fd == wakeup:
                _drain(wakeup)
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                reading = False
                selector.unregister(0)
            *lines, unread = (unread + chunk).split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    _child_exits_unwatched(wakeup, wakeup_write)
                    _child(request)
                children[pid] = request["id"]
                _answer({"id": request["id"], "pid": pid})
        _reap(children)


def _child_exits_wake() -> tuple[int, int]:
    """A pipe that receives a byte on every SIGCHLD (signal.set_wakeup_fd): the template's select
    wakes when a child exits, where it polled every 50 ms before. Returns (read end, write end)."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so that the wakeup fd is written
    return read_end, write_end


def _child_exits_unwatched(*pipe: int) -> None:
    """In a run's child: SIGCHLD back to its default and the template's pipe closed, so that the
    run's own subprocesses behave as in a fresh interpreter."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in pipe:
        os.close(fd)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _reap(children: dict[int, int]) -> None:
    """Answer every run whose child has exited. Other children of the template (the forkserver,
    multiprocessing's resource tracker) are reaped and not answered."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        run_id = children.pop(pid, None)
        if run_id is not None:
            _answer({"id": run_id, "code": os.waitstatus_to_exitcode(status)})


def _answer(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


if __name__ == "__main__":
    _template([name for name in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if name])
