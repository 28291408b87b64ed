"""What a contained world leaves behind, removed when it is torn down (driver side): its processes,
its files in the places any user may write, its System V IPC objects. Every wait here is bounded.

A contained rank runs as a uid of its own (harness/rank/containment.py), so everything it can leave
is marked with that uid: a process (killed by kill(-1) as that uid), a file or folder it made in a
world-writable folder (found by its owner, removed by root), a System V shared memory segment,
semaphore set or message queue (listed in /proc/sysvipc with its owner, removed by root). A file
made with posix_fallocate holds its blocks without a byte written; a segment holds its memory with
no process attached: sized to the disk or the memory limit, either would starve the driver and its
report for the rest of the run, so both go with the world.

The places swept are those the Filesystem Hierarchy Standard makes writable by every user
(WRITABLE_ROOTS: /tmp, /var/tmp, /dev/shm, /dev/mqueue, /run/lock) and every world-writable folder
under them. A world-writable folder elsewhere (none in Ubuntu's image or on this machine:
``find / -xdev -type d -perm -0002`` lists only these) is not swept; scanning the whole filesystem
took 9.4 s here, per world too much.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import stat
import time

WRITABLE_ROOTS = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock")
SYSV_TABLES = {"shm": "shmctl", "sem": "semctl", "msg": "msgctl"}  # /proc/sysvipc/<name>: how to remove it
IPC_RMID = 0
REAP_FIRST_POLL_S, REAP_POLL_S = 0.0005, 0.05
SWEEP_TIMEOUT_S, SWEEP_TRIES = 5.0, 5


def reap(pid: int, timeout_s: float) -> int | None:
    """Wait for the child ``pid`` to end, at most ``timeout_s``; a child that stops (SIGSTOP, its own
    or a peer's of the same uid) or outlives the wait is killed, and then reaped: a contained child
    can never leave the driver in waitpid. Its wait status, or None when it was killed here."""
    deadline, pause = time.monotonic() + timeout_s, REAP_FIRST_POLL_S
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG | os.WUNTRACED)
        except ChildProcessError:
            return None
        if done and not os.WIFSTOPPED(status):
            return status
        if done or time.monotonic() >= deadline:
            break
        time.sleep(pause)  # a sweep's child ends in about a millisecond: first polls are short
        pause = min(REAP_POLL_S, pause * 2)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)  # SIGKILL ends a stopped process too: this returns
    except ChildProcessError:
        pass
    return None


def sweep(sandbox) -> None:
    """Kill every process running as the sandbox's uid, then remove what that uid left: its private
    directory, its files in WRITABLE_ROOTS, its System V IPC objects."""
    kill_all(sandbox.uid)
    shutil.rmtree(sandbox.directory, ignore_errors=True)
    remove_files_of(sandbox.uid)
    remove_ipc_of(sandbox.uid)


def kill_all(uid: int) -> None:
    """kill(-1) as ``uid`` reaches exactly the processes that uid owns: the ranks and whatever they
    started, detached or not."""

    def kill() -> None:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing of that uid is left

    _as_uid(uid, kill)


def _as_uid(uid: int, action) -> None:
    """Run ``action`` (system calls only) in a forked child that has become ``uid``: no exec, since
    the sandbox's uid may not be allowed to run this Python (e.g. one under /root). The child is of
    that uid from its setuid on, so a process of the uid could stop it: the wait is bounded and the
    action tried again."""
    for _ in range(SWEEP_TRIES):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                action()
            except BaseException:  # noqa: BLE001 - the child must never return into the driver's code
                code = 1
            os._exit(code)
        status = reap(pid, SWEEP_TIMEOUT_S)
        if status is not None and os.WIFEXITED(status):
            return


def remove_files_of(uid: int, roots: tuple[str, ...] = WRITABLE_ROOTS) -> list[str]:
    """Remove every file and folder owned by ``uid`` in ``roots`` and in the world-writable folders
    under them (where another uid can create entries); what it removed. Links are never followed
    (lstat; rmtree works on descriptors), and only world-writable folders are entered, so the walk
    is short: a folder of another owner and mode 0755 can hold nothing of this uid's."""
    removed = []
    folders = [root for root in roots if os.path.isdir(root)]
    while folders:
        folder = folders.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_uid == uid:
                _remove(entry.path, info)
                removed.append(entry.path)
            elif stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_IWOTH:
                folders.append(entry.path)
    return removed


def _remove(path: str, info: os.stat_result) -> None:
    try:
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def ipc_of(uid: int) -> dict[str, list[int]]:
    """The System V IPC objects owned (or created) by ``uid``: {"shm": [ids], "sem": [...], "msg": [...]}."""
    found = {}
    for table in SYSV_TABLES:
        try:
            with open(f"/proc/sysvipc/{table}") as listing:
                header = listing.readline().split()
                rows = [dict(zip(header, line.split())) for line in listing]
        except OSError:
            rows = []
        id_column = {"shm": "shmid", "sem": "semid", "msg": "msqid"}[table]
        found[table] = [
            int(row[id_column]) for row in rows if str(uid) in (row.get("uid"), row.get("cuid")) and row.get(id_column, "").isdigit()
        ]
    return found


def remove_ipc_of(uid: int) -> None:
    """IPC_RMID every System V object of ``uid``, as that uid: it owns them, where root in a container
    may not remove another user's (that needs CAP_SYS_ADMIN, which Docker withholds). Its processes
    are gone by then, so no new ones appear; a segment still attached would go with its last user."""
    found = ipc_of(uid)
    if not any(found.values()):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    calls = [(getattr(libc, SYSV_TABLES[table]), ipc_id, table) for table, ids in found.items() for ipc_id in ids]

    def remove() -> None:
        for call, ipc_id, table in calls:
            if table == "sem":
                call(ipc_id, 0, IPC_RMID)
            else:
                call(ipc_id, IPC_RMID, None)

    _as_uid(uid, remove)
