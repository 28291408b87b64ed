"""The system calls a contained rank's allow list refused during a task, read by the driver from
the record the rank's helper keeps (harness/rank/refusal_reporter.py: a root-owned file next to the
rank's log, written by a process of another uid), and said in the task's failure. The rank cannot
rewrite or withhold it: what the implementation's own error says ("Operation not permitted") does
not name the call, this does.

Only a failure's text gains it: a task that passed despite a refused call passed on its values."""

from __future__ import annotations

import os
from collections import Counter

from parallelism_conformance.harness.rank.syscall_allowlist import refused_path

MAX_READ = 1 << 20  # more than the helper writes between two reads (refusal_reporter.RECORD_LIMIT)


def since_last(rank) -> str:
    """'' or a paragraph naming the calls refused to ``rank`` (a RankHandle) since the last read,
    which empties the record (the helper appends, and stops writing at its limit until then). A name
    the helper appends between the read and the emptying is lost: a call refused after the rank's
    reply, by a thread of the implementation that outlived its task."""
    if not rank.log_path:
        return ""
    path = refused_path(rank.log_path)
    try:
        with open(path, "rb") as record:
            chunk = record.read(MAX_READ)
        if chunk:
            os.truncate(path, 0)
    except OSError:
        return ""
    refused = Counter(line.decode("ascii", errors="replace") for line in chunk.split(b"\n") if line)
    if not refused:
        return ""
    calls = ", ".join(f"{name} ({count}x)" for name, count in sorted(refused.items()))
    return (
        f"\nrank {rank.rank}'s system call filter refused, with EPERM, calls outside its allow list "
        f"(harness/rank/syscall_allowlist.py: what the bundled implementations, torch.distributed and "
        f"gloo need; read by the driver from the rank's record): {calls}\n"
    )
