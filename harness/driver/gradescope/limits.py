"""The limits a grading container imposes, read from inside it, and the defaults that fit them.

Gradescope's tiers (its autograder documentation): 0.5 vCPU / 768 MB (the default), 1 / 1.5 GB,
2 / 3 GB, 4 / 6 GB; no GPU; a time limit of 10 minutes by default, 40 at most. Docker imposes
the CPU share as a CFS quota and the memory as the container's cgroup limit, which is what is read
here (cgroup v2's ``cpu.max`` and ``memory.max``, or v1's ``cpu.cfs_quota_us`` and
``memory.limit_in_bytes``); ``sched_getaffinity`` bounds the CPUs where no quota is set."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from parallelism_conformance.harness.driver import rank_memory

CGROUP = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2^63

# What a grading run holds in memory: the driver and a light rank (harness/driver/rank_memory.py,
# measured); the live-rank cap itself follows what this submission's ranks cost as they run.
DRIVER_BYTES = rank_memory.DRIVER_BYTES
RANK_BYTES = rank_memory.FIRST_RANK_BYTES


@dataclass(frozen=True)
class ContainerLimits:
    cpus: float  # CPU time available, in cores
    memory_bytes: int | None  # None: no limit

    def __str__(self) -> str:
        memory = "no memory limit" if self.memory_bytes is None else f"{self.memory_bytes / 2**20:.0f} MiB"
        return f"{self.cpus:g} CPU, {memory}"


def read(root: Path = CGROUP, cgroup_file: Path = Path("/proc/self/cgroup")) -> ContainerLimits:
    """This process's limits (a container sees its own cgroup at the root of its mount)."""
    return ContainerLimits(cpus=_cpus(root, _paths(cgroup_file)), memory_bytes=_memory(root, _paths(cgroup_file)))


def _paths(cgroup_file: Path) -> dict[str, str]:
    """{controller: path} from /proc/<pid>/cgroup ("" is cgroup v2's unified hierarchy)."""
    paths = {}
    try:
        for line in cgroup_file.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    except (OSError, ValueError):
        pass
    return paths


def _first(*candidates: Path) -> str | None:
    for candidate in candidates:
        try:
            return candidate.read_text().strip()
        except OSError:
            continue
    return None


def _cpus(root: Path, paths: dict[str, str]) -> float:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    v2 = _first(root / paths.get("", "/").lstrip("/") / "cpu.max", root / "cpu.max")
    if v2 and v2.split()[0] != "max":
        quota, period = (int(part) for part in v2.split()[:2])
        return min(affinity, quota / period)
    for name in ("cpu", "cpu,cpuacct"):
        if name in paths or (root / name).exists():
            base = root / name / paths.get("cpu", "/").lstrip("/")
            quota = _first(base / "cpu.cfs_quota_us", root / name / "cpu.cfs_quota_us")
            period = _first(base / "cpu.cfs_period_us", root / name / "cpu.cfs_period_us")
            if quota and period and int(quota) > 0:
                return min(affinity, int(quota) / int(period))
    return float(affinity)


def _memory(root: Path, paths: dict[str, str]) -> int | None:
    v2 = _first(root / paths.get("", "/").lstrip("/") / "memory.max", root / "memory.max")
    if v2 and v2 != "max":
        return int(v2)
    base = root / "memory" / paths.get("memory", "/").lstrip("/")
    v1 = _first(base / "memory.limit_in_bytes", root / "memory" / "memory.limit_in_bytes")
    if v1 and int(v1) < UNLIMITED:
        return int(v1)
    return None


def first_rank_bytes(import_bytes: int = 0) -> int:
    """The first estimate of one live rank of this submission, before its ranks are measured running:
    a light rank plus what importing the submission added (the autograder's import check)."""
    return RANK_BYTES + max(0, import_bytes)


def live_ranks_for(memory_bytes: int | None, import_bytes: int = 0) -> int | None:
    """How many ranks of the first estimate fit in ``memory_bytes`` beside the driver (the run lowers
    it as it measures larger ranks); None where there is no limit."""
    if memory_bytes is None:
        return None
    return max(1, (memory_bytes - DRIVER_BYTES) // first_rank_bytes(import_bytes))


# The smallest of Gradescope's tiers measured to grade a correct submission with full marks within
# the platform's default 10 minutes (docs/measured.md, "Grading tiers", the autograder rows):
# every capability, the bundled implementations handed in; the CS336 set, a repository whose
# training ranks weigh what a real 2026 one's do (tests/fixtures/cs336_submission, adapters_heavy.py).
HOLDS = {"every capability": (1.0, 1536 << 20), "the CS336 set": (1.0, 1536 << 20)}


def tier_advice(container: ContainerLimits, claimed: str) -> str | None:
    """What course staff read first where this container is below the tier measured to hold the
    ``claimed`` set (a key of HOLDS); None where it holds it."""
    cpus, memory = HOLDS[claimed]
    short = [
        *([f"{container.cpus:g} CPU (at least {cpus:g})"] if container.cpus < cpus else []),
        *(
            [f"{container.memory_bytes >> 20} MiB (at least {memory >> 20})"]
            if container.memory_bytes is not None and container.memory_bytes < memory
            else []
        ),
    ]
    if not short:
        return None
    return (
        f"this container's tier does not hold {claimed}: {' and '.join(short)}; measured, {cpus:g} vCPU / "
        f"{memory >> 20} MiB grades it with full marks within 10 minutes (docs/measured.md, 'Grading tiers'). "
        "Here, tests past the time budget are 'not run' and those the memory cannot hold 'not graded'."
    )
