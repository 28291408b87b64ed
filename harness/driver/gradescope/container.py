"""A grading container emulated without Docker: what Gradescope imposes on a submission's run,
imposed on one command here, as root. Each part is a kernel mechanism Docker itself uses:

* Docker's default capability set (moby ``oci/caps/defaults.go``): the bounding set reduced to it
  and the command exec'd as root, so its permitted and effective sets are exactly that set
  (``setpriv --bounding-set``; for root, exec grants the bounding set);
* a CPU quota and a memory limit (cgroup v1 ``cpu`` and ``memory`` controllers: a group of the
  emulation's own, removed afterwards), whose peak usage is read back;
* no network (a network namespace of its own: ``unshare -n``, loopback only).

Used by tests/test_autograder.py and the tier benchmark (perf/tiers.py)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

DOCKER_DEFAULT_CAPABILITIES = (
    "chown",
    "dac_override",
    "fowner",
    "fsetid",
    "kill",
    "setgid",
    "setuid",
    "setpcap",
    "net_bind_service",
    "net_raw",
    "sys_chroot",
    "mknod",
    "audit_write",
    "setfcap",
)
CGROUP_ROOT = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000


@dataclass(frozen=True)
class Limits:
    cpus: float | None = None  # a CPU quota in cores (0.5: half a core's time); None: unlimited
    memory_bytes: int | None = None  # None: unlimited
    docker_capabilities: bool = True
    network: bool = False


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    peak_memory_bytes: int | None  # the memory cgroup's peak (page cache included), None without a limit
    peak_pss_bytes: int | None  # the largest sum of proportional set sizes over the run's processes, sampled
    oom_kills: int | None  # the kernel's out-of-memory kills in the group, None where unknown
    leftovers: list[int]  # processes still in the run's groups when its command ended (killed after)


def unavailable(limits: Limits) -> str | None:
    """Why this machine cannot emulate ``limits`` (the reason a test is skipped with), or None."""
    if os.geteuid() != 0:
        return "the emulation needs root (cgroups, capabilities, namespaces)"
    needed = [tool for tool in ("setpriv", "unshare") if shutil.which(tool) is None]
    if needed:
        return f"the emulation needs {', '.join(needed)} (util-linux)"
    for controller, wanted in (("cpu", limits.cpus), ("memory", limits.memory_bytes)):
        if wanted is not None and not (CGROUP_ROOT / controller / "cgroup.procs").exists():
            return f"no cgroup v1 {controller} controller at {CGROUP_ROOT / controller}"
    return None


def command_in_container(command: list[str], limits: Limits) -> list[str]:
    """``command`` wrapped so that it runs without network and with Docker's capabilities."""
    wrapped = list(command)
    if limits.docker_capabilities:
        bounding = ",".join(["-all", *(f"+{name}" for name in DOCKER_DEFAULT_CAPABILITIES)])
        wrapped = ["setpriv", "--bounding-set", bounding, "--inh-caps", "-all", "--", *wrapped]
    if not limits.network:
        wrapped = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up 2>/dev/null; exec "$@"', "sh", *wrapped]
    return wrapped


class _Groups:
    """The cgroups of one run: made before it, removed after it."""

    def __init__(self, limits: Limits):
        self.name = f"conformance-emulation-{secrets.token_hex(4)}"
        self.paths: list[Path] = []
        if limits.cpus is not None:
            cpu = self._make("cpu")
            (cpu / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (cpu / "cpu.cfs_quota_us").write_text(str(int(limits.cpus * CFS_PERIOD_US)))
        self.memory = None
        if limits.memory_bytes is not None:
            self.memory = self._make("memory")
            (self.memory / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            swap = self.memory / "memory.memsw.limit_in_bytes"
            if swap.exists():  # no swapping past the limit: a container's memory is its limit
                swap.write_text(str(limits.memory_bytes))

    def _make(self, controller: str) -> Path:
        path = CGROUP_ROOT / controller / self.name
        path.mkdir()
        self.paths.append(path)
        return path

    def join(self) -> None:
        """Move the calling process (the child, before exec) into every group."""
        for path in self.paths:
            (path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        return int((self.memory / "memory.max_usage_in_bytes").read_text()) if self.memory else None

    def oom_kills(self) -> int | None:
        if self.memory is None:
            return None
        for line in (self.memory / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return None

    def watch_pss(self, interval_s: float = 0.5) -> threading.Event:
        """Sample the summed proportional set size of the groups' processes until the event is set:
        what the run's processes hold, each shared page counted once in all (the cgroup's peak also
        counts the page cache of every file read)."""
        done = threading.Event()
        self.peak_pss = 0

        def sample() -> None:
            while not done.wait(interval_s):
                self.peak_pss = max(self.peak_pss, sum(_pss(pid) for pid in self.members()))

        threading.Thread(target=sample, daemon=True).start()
        return done

    def members(self) -> list[int]:
        return sorted({int(pid) for path in self.paths for pid in (path / "cgroup.procs").read_text().split()})

    def settled_members(self, patience_s: float = 60.0) -> list[int]:
        """What is left in the groups once multiprocessing's helpers (the forkserver, the resource
        tracker: they exit on their own when the driver's end of their pipe closes) had time to go:
        an event (the group empties), with a generous upper guard (on a loaded machine they took over
        10 s to be scheduled)."""
        end = time.monotonic() + patience_s
        while self.members() and time.monotonic() < end:
            time.sleep(0.1)
        return self.members()

    def remove(self) -> None:
        for path in self.paths:
            for _ in range(50):  # the group empties once its last process is reaped
                try:
                    path.rmdir()
                    break
                except OSError:
                    for pid in (path / "cgroup.procs").read_text().split():
                        try:
                            os.kill(int(pid), 9)
                        except (ProcessLookupError, ValueError):
                            pass
                    time.sleep(0.1)


def run(command: list[str], limits: Limits, *, cwd: str | Path, env: dict | None = None, timeout_s: float = 900) -> Outcome:
    """Run ``command`` in the emulated container; every process it leaves is killed with the group."""
    reason = unavailable(limits)
    if reason:
        raise RuntimeError(reason)
    groups = _Groups(limits)
    sampling = groups.watch_pss() if groups.paths else None
    started = time.monotonic()
    try:
        completed = subprocess.run(
            command_in_container(command, limits), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, preexec_fn=groups.join
        )
        seconds = time.monotonic() - started
        if sampling is not None:
            sampling.set()
        return Outcome(
            completed.returncode,
            completed.stdout,
            completed.stderr,
            seconds,
            groups.peak(),
            groups.peak_pss if sampling is not None else None,
            groups.oom_kills(),
            groups.settled_members(),
        )
    finally:
        groups.remove()


def _pss(pid: int) -> int:
    """A process's proportional set size in bytes (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            return next(int(line.split()[1]) << 10 for line in rollup if line.startswith("Pss:"))
    except (OSError, StopIteration, ValueError):
        return 0
