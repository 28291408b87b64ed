"""The kernel's I/O counters of a world's local ranks (/proc/<pid>/io): what the deadlock watch
reads to know that no byte moves, and the audit's count of the bytes a rank wrote, which the rank
cannot lower."""

from __future__ import annotations

from parallelism_conformance.harness.driver import deadlock, socket_counters
from parallelism_conformance.harness.rank import containment


class IoCounters:
    """Read here, or, where the driver may not (no CAP_SYS_PTRACE over a contained rank: a container's
    default capabilities), by a reader with the ranks' own uid (containment.CounterReader), started
    on the first read that needs it and closed with the world."""

    def __init__(self, sandbox: containment.Sandbox | None):
        self._sandbox = sandbox
        self._reader: containment.CounterReader | None = None
        self._tcp = socket_counters.TcpCounters()

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

    def sent(self, ranks) -> list[int | None]:
        """Per rank (harness/driver/rank_handle.RankHandle), the bytes the kernel counted it sending:
        what its process wrote (wchar) plus, for a contained rank, what its store connection sent (the
        one socket its system call filter lets it ``send`` on, which wchar does not count). None for an
        attached rank, and where either count cannot be read or the rank runs unfiltered: the audit
        then fails the task with :meth:`why_unread`'s reason rather than trust a partial count."""
        written = self.written([None if r.attached else r.process.pid for r in ranks])
        if self._sandbox is None:
            return written
        inodes = {r.store_socket for r in ranks if r.store_socket is not None}
        try:
            store = self._tcp.sent(inodes)
        except (OSError, socket_counters.Unreadable):
            store = {}
        return [
            None if count is None or rank.store_socket not in store else count + store[rank.store_socket] for rank, count in zip(ranks, written)
        ]

    def why_unread(self, rank) -> str:
        """Why :meth:`sent` had no count for ``rank`` ('' for an attached rank: its host is another)."""
        if rank.attached:
            return ""
        if rank.unfiltered:
            return (
                f"rank {rank.rank}: its system call filter could not be installed ({rank.unfiltered}), so bytes it "
                "sent with send, sendmsg or splice would not be counted (harness/rank/syscall_filter.py)"
            )
        if self._sandbox is not None and rank.store_socket is not None:
            return f"rank {rank.rank}: the kernel's count of the bytes it wrote, or of those its store connection sent, could not be read"
        return (
            f"rank {rank.rank}: the kernel's count of the bytes it wrote could not be read (its /proc entry "
            "refused the driver; a rank that makes itself undumpable hides it)"
        )

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._tcp.close()
