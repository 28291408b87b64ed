"""Many short pytest runs without paying for Python and torch each time.

The mutation runner (harness/driver/mutation.py) starts about 170 pytest runs; a mutant's run takes
5-10 s, of which a fresh interpreter importing torch and pytest is about 1.2 s on this machine
(measured: one targeted mutant run, 4.0 s as a subprocess against 2.8 s forked from an interpreter
that had imported them). ``WarmPytest`` starts one *template* process
(``python -m harness.driver.warm_pytest``) that imports torch and pytest once and then
forks one fresh child per run; the child calls ``pytest.main`` with the run's arguments, its stdout
and stderr going to a file, and exits with pytest's exit code.

Every run is still its own process, as a subprocess run is: its own pytest session, its own
worlds of ranks and its own forkserver, which exits with it. The template imports no module of
this repository and no pytest plugin (hypothesis is one), so pytest still rewrites the assertions
of the plugins and the tests in each child (a module imported before pytest starts cannot be
rewritten: pytest warns). The template is single-threaded by
design (forking a process with threads of its own can leave a lock held in the child); torch's
import starts one native thread, the state the harness's forkserver already forks every rank from.

Protocol (one JSON object per line): the driver writes ``{"id", "args", "cwd", "env", "output"}`` to the
template's stdin; the template answers ``{"id", "code"}`` on its stdout when that child has exited
(a child killed by a signal answers -signal). If the template dies or cannot start, every run not
yet answered, and every later one, runs as a plain subprocess instead: slower, never lost.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future

WARM_IMPORTS = ("torch", "torch.distributed", "pytest")  # hypothesis (45 ms) is a pytest plugin: left out


class WarmPytest:
    """Driver side: ``run(args, cwd)`` -> (exit code, output, seconds), callable from many threads."""

    def __init__(self, python: str = sys.executable):
        self._python = python
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, str]] = {}
        self._next_id = 0
        self._template: subprocess.Popen | None = None
        self._broken = ""
        try:
            here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            self._template = subprocess.Popen([python, "-m", "harness.driver.warm_pytest"], cwd=here,
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            threading.Thread(target=self._read_answers, name="warm-pytest-answers", daemon=True).start()
        except OSError as error:
            self._broken = f"the template did not start: {error}"

    def run(self, args: list[str], cwd: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
        """``env``: variables the run sees on top of this process's environment."""
        started = time.monotonic()
        handle, output_path = tempfile.mkstemp(prefix="warm-pytest-", suffix=".log")
        os.close(handle)
        try:
            future = self._submit(args, cwd, output_path, env or {})
            code = future.result() if future is not None else None
            if code is None:  # no template: the same run as a plain subprocess
                done = subprocess.run([self._python, "-m", "pytest", *args], cwd=cwd, capture_output=True, text=True,
                                      env={**os.environ, **(env or {})})
                return done.returncode, done.stdout + done.stderr, time.monotonic() - started
            with open(output_path, errors="replace") as output:
                text = output.read()
            if code < 0:
                text += f"\n(the pytest run was killed by signal {-code})\n"
            return code, text, time.monotonic() - started
        finally:
            os.unlink(output_path)

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
    def _submit(self, args, cwd, output_path, env) -> Future | None:
        with self._lock:
            if self._broken or self._template is None:
                return None
            future: Future = Future()
            run_id = self._next_id
            self._next_id += 1
            self._pending[run_id] = (future, output_path)
            try:
                self._template.stdin.write(json.dumps({"id": run_id, "args": args, "cwd": cwd, "env": env,
                                                       "output": output_path}) + "\n")
                self._template.stdin.flush()
            except (OSError, ValueError) as error:
                self._fail_all(f"the template stopped reading: {error}")
        return future

    def _read_answers(self) -> None:
        for line in self._template.stdout:
            answer = json.loads(line)
            with self._lock:
                future, _ = self._pending.pop(answer["id"])
            future.set_result(answer["code"])
        with self._lock:
            self._fail_all(f"the template exited with code {self._template.wait()}")

    def _fail_all(self, why: str) -> None:
        """Called with the lock held: the runs not answered fall back to subprocesses."""
        self._broken = why
        for future, _ in self._pending.values():
            future.set_result(None)
        self._pending.clear()


# ------------------------------------------------------------------------------------- template
def _child(request: dict) -> None:
    """In the forked child: never returns."""
    code = 3
    try:
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


def _template() -> None:
    for module in WARM_IMPORTS:
        __import__(module)
    children: dict[int, int] = {}  # pid -> run id
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    unread = b""
    reading = True
    while reading or children:
        if reading and selector.select(timeout=0.05):
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
                    _child(request)
                children[pid] = request["id"]
        elif not reading:
            time.sleep(0.05)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            run_id = children.pop(pid)
            os.write(1, (json.dumps({"id": run_id, "code": os.waitstatus_to_exitcode(status)}) + "\n").encode())


if __name__ == "__main__":
    _template()
