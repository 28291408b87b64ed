"""What the driver keeps of a rank's captured output: the head and the tail, every byte counted.

A rank's stdout and stderr go through a FIFO into a log file of the driver's
(harness/driver/output_pipe.py) that the driver reads after each task. It once read all of it and decoded it: ranks of a correct all_reduce that
printed 1 GiB each (a forgotten debug print, or on purpose) got the driver OOM-killed in a 3 GiB
grading container (results.json held 0 tests), and without a limit its peak RSS reached 8.6 GB for
2 GiB a rank. Now the driver reads at most HEAD_BYTES + TAIL_BYTES of a task's output per rank,
seeking over the rest, and says how many bytes it left out; the count of bytes printed stays exact
because the communication audit subtracts it from the kernel's count of bytes the rank wrote
(harness/driver/world.py, World._run).
"""

from __future__ import annotations

import os
import re
from typing import BinaryIO

# The head holds what a rank printed first (an import warning, the first error), the tail what it
# printed last (the last traceback, and a hung rank's stacks: faulthandler writes them at the end).
# 64 KiB each is over ten times what a failure report shows (failures.MAX_LOG_CHARS) and nothing
# next to the driver's own few hundred MB, whatever the rank prints.
HEAD_BYTES = 64 * 1024
TAIL_BYTES = 64 * 1024

# A log file past this size is emptied when the next task starts, the driver having counted all of
# it: the disk then holds one task's output per rank, not the whole run's (a rank that printed 1 GiB
# per task filled /tmp). Below it the file is left alone: a quiet rank's log is not truncated every task.
LOG_FILE_LIMIT = 1 << 20

_LEFT_OUT = re.compile(r"\n\[\.\.\. (\d+) bytes of this rank's output left out \.\.\.\]\n")


def left_out(count: int) -> str:
    """The line that stands for ``count`` bytes not kept (on a line of its own)."""
    return f"\n[... {count} bytes of this rank's output left out ...]\n"


def read_bounded(file: BinaryIO, start: int, end: int, head_bytes: int = HEAD_BYTES, tail_bytes: int = TAIL_BYTES) -> tuple[str, int]:
    """The bytes ``[start, end)`` of ``file`` (opened binary) as text, at most ``head_bytes`` from
    their start and ``tail_bytes`` from their end with a left_out line between, and how many bytes
    the range held. It reads no more than it keeps (it seeks over the middle), so the driver's
    memory is bounded whatever a rank prints. A head that ends early (the file emptied meanwhile:
    pass_over) is all there is."""
    file.seek(start)
    head = file.read(min(head_bytes, end - start))
    if len(head) < min(head_bytes, end - start):
        return head.decode(errors="replace"), len(head)
    tail_start = max(start + len(head), end - tail_bytes)
    skipped = tail_start - (start + len(head))
    file.seek(tail_start)
    tail = file.read(end - tail_start)
    consumed = len(head) + skipped + len(tail)
    if not skipped:
        return (head + tail).decode(errors="replace"), consumed  # joined first: a character split between them survives
    return head.decode(errors="replace") + left_out(skipped) + tail.decode(errors="replace"), consumed


def shorten(text: str, head_chars: int, tail_chars: int) -> str:
    """``text`` (output as read_bounded returns it) cut to at most ``head_chars`` of its start and
    ``tail_chars`` of its end, for a report. What is cut is added to the left_out line's count (in
    UTF-8 bytes), so the report still says how much of the rank's output it does not show. A rank
    can print a line that looks like the left_out line: it then misstates the count shown, never
    the count the audit uses (World._run counts bytes as it reads them)."""
    found = _LEFT_OUT.search(text)
    if found is None and len(text) <= head_chars + tail_chars:
        return text
    if found is None:
        head, count, tail = text[: len(text) - tail_chars], 0, text[len(text) - tail_chars :]
    else:
        head, count, tail = text[: found.start()], int(found[1]), text[found.end() :]
    kept_head, kept_tail = head[:head_chars], tail[max(0, len(tail) - tail_chars) :]
    count += _utf8_length(head[head_chars:]) + _utf8_length(tail[: len(tail) - len(kept_tail)])
    return kept_head + left_out(count) + kept_tail if count else kept_head + kept_tail


def _utf8_length(text: str) -> int:
    return len(text.encode(errors="replace"))


def read_new(path: str, position: int) -> tuple[str, int, int]:
    """What the log file at ``path`` holds past ``position``: its text as read_bounded keeps it, the
    bytes it held, and the position to start from next time."""
    if os.path.getsize(path) == position:  # nothing new, the usual case: no open (1 us against 5 us)
        return "", 0, position
    with open(path, "rb") as log:
        end = os.fstat(log.fileno()).st_size
        start = _start(position, end)
        text, consumed = read_bounded(log, start, end)
    return text, consumed, start + consumed


def pass_over(path: str, position: int) -> tuple[int, int]:
    """Count, without reading them, the bytes the log file at ``path`` holds past ``position``, and
    empty the file once it is past LOG_FILE_LIMIT: (bytes passed over, the position to start from
    next time).

    Emptying is sound because only the driver writes the file, at its end as it then is
    (harness/driver/output_pipe.py: RankPipe.drain, under the lock that the callers hold too), and
    only after draining the rank's FIFO and counting all the file held, when a task starts, so no
    task's output goes uncounted."""
    end = os.path.getsize(path)
    passed = end - _start(position, end)
    if end <= LOG_FILE_LIMIT:
        return passed, end
    os.truncate(path, 0)
    return passed, 0


def _start(position: int, end: int) -> int:
    """Where the new output begins: at ``position``, or at 0 when the file is shorter than that
    (emptied meanwhile: all of it is new)."""
    return position if end >= position else 0
