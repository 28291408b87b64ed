"""The submission copied where contained ranks can read it, without root ever following a path the
submission controls.

``run_autograder`` runs as root, and the submission is the student's: a symbolic link in it (a zip
keeps links, and so does the platform's unzip) pointing at a file only root may read would otherwise
be copied as a link, compiled by the precheck as root and its first line shown in the student's
failure. So only regular files and folders are staged, each opened without following a link
(O_NOFOLLOW; folders listed with lstat), and a regular file with more than one name (a hard link,
which may share a root-only file's inode) is left out as well. What was left out is said, by name,
to the student."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

CHUNK = 1 << 20


def stage(submission: Path) -> tuple[Path, list[str]]:
    """A fresh copy of ``submission`` that contained ranks can read and not write (root's, folders
    0755, files 0644), and what was left out, as "name (why)"."""
    staged = Path(tempfile.mkdtemp(prefix="conformance-submission-"))
    os.chmod(staged, 0o755)
    left_out: list[str] = []
    _copy_folder(submission, staged, Path("."), left_out)
    return staged, left_out


def _copy_folder(source: Path, target: Path, relative: Path, left_out: list[str]) -> None:
    for entry in sorted(os.scandir(source), key=lambda e: e.name):
        name = relative / entry.name
        info = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(info.st_mode):
            (target / entry.name).mkdir(mode=0o755)
            os.chmod(target / entry.name, 0o755)
            _copy_folder(Path(entry.path), target / entry.name, name, left_out)
        elif stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
            if not _copy_file(Path(entry.path), target / entry.name):
                left_out.append(f"{name} (it changed while it was copied)")
        else:
            left_out.append(f"{name} ({_kind(info)})")


def _copy_file(source: Path, target: Path) -> bool:
    """Copy a regular file, refusing a link put in its place since it was listed."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        with open(target, "wb") as out:
            while chunk := os.read(fd, CHUNK):
                out.write(chunk)
    finally:
        os.close(fd)
    os.chmod(target, 0o644)
    return True


def _kind(info: os.stat_result) -> str:
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link: only regular files are graded"
    if stat.S_ISREG(info.st_mode):
        return "a file with several names (a hard link): only files of one name are graded"
    return "not a regular file"


def explained(message: str, left_out: list[str], limit: int = 12) -> str:
    """``message`` with what staging left out, for a precheck failure."""
    if not left_out:
        return message
    shown = ", ".join(left_out[:limit]) + (f" and {len(left_out) - limit} more" if len(left_out) > limit else "")
    return f"{message} Left out of the submission: {shown}."
