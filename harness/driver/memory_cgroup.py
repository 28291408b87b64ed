"""Whether the kernel's out-of-memory killer killed a rank, from the memory cgroup it lived in.

A rank that allocates past a grading container's memory limit is killed with SIGKILL by the
kernel's OOM killer, and was reported as "killed by SIGKILL", which reads like something the
implementation or the harness did. The kernel counts its kills per memory cgroup, before it sends
the signal (mm/oom_kill.c: "raise event before sending signal"): ``oom_kill`` in
``memory.oom_control`` (cgroup v1, Linux 4.13 on) or in ``memory.events`` (cgroup v2). The driver
reads the count of the cgroup a rank lives in when a task starts and again when the rank died by
SIGKILL: when it rose, the OOM killer did it. The count is the cgroup's, not the rank's: another
process of the same cgroup killed for memory during that task is taken for it (in a grading
container the cgroup holds only the driver and the ranks).

The parsers are pure functions over the text of /proc/<pid>/cgroup, /proc/self/mountinfo and the
cgroup's files (tests/test_bounded_output.py feeds them fake ones); :func:`of_process` and
:class:`MemoryCgroup` read the real files. Driver side only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit count (9223372036854771712
# with 4 KiB pages); anything this large is no limit on any machine.
UNLIMITED = 1 << 62


@dataclass(frozen=True)
class Mount:
    root: str  # the cgroup path this mount shows at its mount point ("/" unless it is a container's view)
    mount_point: str
    version: int  # 1: a v1 hierarchy with the memory controller; 2: the unified hierarchy


def memory_paths(proc_cgroup: str) -> dict[int, str]:
    """{version: cgroup path} from the text of /proc/<pid>/cgroup: the v1 hierarchy whose
    controllers include ``memory`` (``4:memory:/docker/abc``) and the unified one (``0::/path``)."""
    paths = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths[2] = path
        elif "memory" in controllers.split(","):
            paths[1] = path
    return paths


def memory_mounts(mountinfo: str) -> list[Mount]:
    """The memory cgroup mounts in the text of /proc/self/mountinfo (proc(5)): v1 ``cgroup``
    mounts whose super options name ``memory``, and ``cgroup2`` mounts."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        fstype, options = after[0], (after[2] if len(after) > 2 else "")
        if fstype == "cgroup" and "memory" in options.split(","):
            mounts.append(Mount(_unescape(fields[3]), _unescape(fields[4]), 1))
        elif fstype == "cgroup2":
            mounts.append(Mount(_unescape(fields[3]), _unescape(fields[4]), 2))
    return mounts


def locate(proc_cgroup: str, mountinfo: str) -> MemoryCgroup | None:
    """The memory cgroup of a process, from the texts of its /proc/<pid>/cgroup and of
    /proc/self/mountinfo; None where no mount shows it. A v1 memory hierarchy wins over the unified
    one: on a hybrid system (v1 controllers, cgroup2 mounted beside them) the unified hierarchy
    holds no memory controller."""
    paths = memory_paths(proc_cgroup)
    for version in (1, 2):
        path = paths.get(version)
        for mount in (m for m in memory_mounts(mountinfo) if m.version == version and path is not None):
            relative = _below(path, mount.root)
            if relative is not None:
                return MemoryCgroup(os.path.join(mount.mount_point, relative).rstrip("/") or "/", version, mount.mount_point)
    return None


def oom_kills(text: str) -> int | None:
    """The ``oom_kill`` count in the text of memory.oom_control (v1) or memory.events (v2); None
    when it is not there (a kernel before 4.13)."""
    found = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(found[1]) if found else None


def v1_limit(stat: str) -> int | None:
    """The limit that applies to a v1 cgroup, its ancestors' included: ``hierarchical_memory_limit``
    in the text of its memory.stat; None for no limit."""
    found = re.search(r"^hierarchical_memory_limit (\d+)$", stat, re.MULTILINE)
    return int(found[1]) if found and int(found[1]) < UNLIMITED else None


def v2_limit(maxima: list[str]) -> int | None:
    """The limit that applies to a v2 cgroup: the least of the memory.max texts of it and its
    ancestors ("max" is no limit); None for no limit."""
    numbers = [int(text) for text in (m.strip() for m in maxima) if text.isdigit()]
    return min(numbers) if numbers else None


# What a cgroup holds that the kernel cannot reclaim without killing: anonymous memory, the file pages
# its processes map (libraries: charged once, whoever maps them) and shared memory. Page cache no
# process maps is left out: the kernel reclaims it before it kills. memory.stat's names, per version.
HELD = {1: ("total_rss", "total_mapped_file", "total_shmem"), 2: ("anon", "file_mapped", "shmem")}


def held(stat: str, version: int) -> int | None:
    """The sum of HELD's fields in the text of a cgroup's memory.stat; None where one is missing."""
    values = dict(line.split()[:2] for line in stat.splitlines() if len(line.split()) >= 2)
    fields = [values.get(name) for name in HELD[version]]
    return None if any(v is None or not v.isdigit() for v in fields) else sum(int(v) for v in fields)


OOM_KILLED = "was killed by the kernel's out-of-memory killer"


def describe_oom_kill(limit: int | None) -> str:
    """How a rank the OOM killer killed is reported (after "rank 2 ")."""
    if limit is None:
        return f"{OOM_KILLED} (its memory cgroup sets no limit: the machine ran out)"
    return f"{OOM_KILLED} (the container's memory limit is {limit / 2**20:.0f} MiB)"


@dataclass(frozen=True)
class MemoryCgroup:
    """A memory cgroup's directory, read for its OOM kill count and its limit."""

    directory: str
    version: int
    mount_point: str = "/"  # where its hierarchy is mounted: v2 limits are looked for up to here

    def oom_kills(self) -> int | None:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        text = _read(os.path.join(self.directory, name))
        return None if text is None else oom_kills(text)

    def held(self) -> int | None:
        """What it holds that the kernel cannot reclaim (``held``); None where memory.stat says not."""
        text = _read(os.path.join(self.directory, "memory.stat"))
        return None if text is None else held(text, self.version)

    def limit(self) -> int | None:
        if self.version == 1:
            return v1_limit(_read(os.path.join(self.directory, "memory.stat")) or "")
        maxima, directory = [], self.directory
        while True:
            maxima.append(_read(os.path.join(directory, "memory.max")) or "max")
            if os.path.normpath(directory) == os.path.normpath(self.mount_point) or directory in ("/", ""):
                return v2_limit(maxima)
            directory = os.path.dirname(directory)


def of_process(pid: int) -> MemoryCgroup | None:
    """The memory cgroup process ``pid`` lives in, where this system shows one whose OOM kill count
    can be read; else None (no memory controller, no /proc, a kernel before 4.13)."""
    proc_cgroup, mountinfo = _read(f"/proc/{pid}/cgroup"), _read("/proc/self/mountinfo")
    group = None if proc_cgroup is None or mountinfo is None else locate(proc_cgroup, mountinfo)
    return group if group is not None and group.oom_kills() is not None else None


def own_limit() -> int | None:
    """This process's memory limit (in a grading run the container's), None where none is known."""
    group = of_process(os.getpid())
    return None if group is None else group.limit()


def _below(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` (both cgroup paths), or None when it is not under it."""
    path, root = path.rstrip("/") or "/", root.rstrip("/") or "/"
    if root == "/":
        return path.lstrip("/")
    if path == root:
        return ""
    return path[len(root) + 1 :] if path.startswith(root + "/") else None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _read(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return None
