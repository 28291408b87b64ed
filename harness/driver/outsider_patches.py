"""A buggy implementation under outsiders/ kept as a unified diff against its author's correct file:
``outsiders/<capability>/bugs/<name>.diff``, headed ``--- <correct file>`` and ``+++ <name>.py``
(both in ``<capability>/``), 3 lines of context, as difflib.unified_diff writes it. ``patched``
applies one strictly: every context and removed line must match the base exactly where its hunk
says, else ValueError naming the diff and the hunk. ``materialise`` writes the buggy file under its
own name into a directory, world-readable (the ranks may run as another user). ``unified`` writes
such a diff; a last line without a newline is followed by ``\\ No newline at end of file``.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
NO_NEWLINE = "\\ No newline at end of file\n"


def _lines(text: str) -> list[str]:
    """Split at '\\n' only (str.splitlines also splits at '\\r', '\\x0c', ...), keeping the ends."""
    return re.findall(r"[^\n]*\n|[^\n]+\Z", text)


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8")  # no newline translation: byte for byte


def unified(base: Path, buggy: Path) -> str:
    """The diff that turns ``base`` into ``buggy`` (both in one folder), in the form ``patched`` reads."""
    out = []
    for line in difflib.unified_diff(_lines(_read(base)), _lines(_read(buggy)), base.name, buggy.name, n=3):
        out.append(line if line.endswith("\n") else line + "\n" + NO_NEWLINE)
    return "".join(out)


def patched(diff_path: Path) -> tuple[str, str]:
    """(the buggy file's name, its text): the diff applied to its base, ``diff_path.parent.parent``'s
    file named in its ``---`` line."""
    diff = _lines(_read(diff_path))
    if len(diff) < 3 or not diff[0].startswith("--- ") or not diff[1].startswith("+++ "):
        raise ValueError(f"{diff_path}: not a unified diff ('--- base', '+++ name', hunks)")
    base_name, name = diff[0][4:].rstrip("\n"), diff[1][4:].rstrip("\n")
    if "/" in base_name or "/" in name or not name.endswith(".py"):
        raise ValueError(f"{diff_path}: '---' and '+++' must name files of one folder, got {base_name!r}, {name!r}")
    base_path = diff_path.parent.parent / base_name
    base = _lines(_read(base_path))
    out: list[str] = []
    at = 0  # lines of base consumed
    i = 2
    while i < len(diff):
        header = HUNK.match(diff[i])
        if not header:
            raise ValueError(f"{diff_path}: line {i + 1} is not a hunk header: {diff[i]!r}")
        hunk = f"hunk {diff[i].strip()}"
        old_len = 1 if header[2] is None else int(header[2])
        start = int(header[1]) - (1 if old_len else 0)  # 0-based; an insertion's header names the line before
        if start < at or start > len(base):
            raise ValueError(f"{diff_path}: {hunk} starts at line {start + 1} of {base_name}, out of order or past its {len(base)} lines")
        out += base[at:start]
        at = start
        old = new = 0
        i += 1
        while i < len(diff) and not diff[i].startswith("@@"):
            tag, line = diff[i][:1], diff[i][1:]
            if tag not in " -+":
                raise ValueError(f"{diff_path}: {hunk}: line {i + 1} of the diff is neither context, '-' nor '+'")
            if i + 1 < len(diff) and diff[i + 1] == NO_NEWLINE:
                line = line.removesuffix("\n")
                i += 1
            if tag in " -":
                if at >= len(base) or base[at] != line:
                    found = repr(base[at]) if at < len(base) else "the end of the file"
                    raise ValueError(f"{diff_path}: {hunk} does not apply to {base_name}: line {at + 1} is {found}, the diff expects {line!r}")
                at += 1
                old += 1
            if tag in " +":
                out.append(line)
                new += 1
            i += 1
        if (old, new) != (old_len, 1 if header[4] is None else int(header[4])):
            raise ValueError(f"{diff_path}: {hunk} holds {old} old and {new} new lines, not what its header says")
    return name, "".join(out + base[at:])


def materialise(diff_path: Path, into_dir: Path) -> Path:
    """Writes the buggy file under its own name into ``into_dir`` (mode 0o644); returns its path."""
    name, text = patched(diff_path)
    path = into_dir / name
    path.write_bytes(text.encode("utf-8"))
    path.chmod(0o644)
    return path
