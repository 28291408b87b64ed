"""The kernel's I/O counters of a world's local ranks (/proc/<pid>/io): what the deadlock watch
reads to know that no byte moves, and the audit's count of the bytes a rank wrote, which the rank
cannot lower."""
from __future__ import annotations

from parallelism_conformance.harness.driver import deadlock
from parallelism_conformance.harness.rank import containment


class IoCounters:
    """Read here, or, where the driver may not (no CAP_SYS_PTRACE over a contained rank: a container's
    default capabilities), by a reader with the ranks' own uid (containment.CounterReader), started
    on the first read that needs it and closed with the world."""

    def __init__(self, sandbox: containment.Sandbox | None):
        self._sandbox = sandbox
        self._reader: containment.CounterReader | None = None

    def read(self, pids: list[int]) -> list[dict[str, int] | None]:
        """Each process's counters, in order; None where unreadable."""
        counters = [deadlock.read_io_counters(pid) for pid in pids]
        unread = [i for i, found in enumerate(counters) if found is None]
        if unread and self._sandbox is not None:
            if self._reader is None:
                self._reader = containment.CounterReader(self._sandbox.uid)
            for i, answer in zip(unread, self._reader.read([pids[i] for i in unread])):
                counters[i] = answer
        return counters

    def written(self, pids: list[int | None]) -> list[int | None]:
        """Per pid, the bytes its process has written (wchar); None for a None pid (an attached rank)
        or one whose counters cannot be read."""
        known = [pid for pid in pids if pid is not None]
        read = dict(zip(known, self.read(known)))
        return [None if read.get(pid) is None else read[pid].get("wchar") for pid in pids]

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
