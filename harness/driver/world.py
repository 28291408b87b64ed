"""A world: n rank processes that joined one process group once and then run task after task.

Driver side. Ranks are started with multiprocessing's forkserver, torch preloaded (about 0.1 s for
four ranks on this machine against 3.6 s with spawn), join a process group through the driver's
TCPStore under a prefix of their own (no port races with other runs or xdist workers), and connect
back over an authenticated loopback socket that carries tasks and results. A world can instead be
made of ranks a launcher started (torchrun, on other hosts too): they dial the pool's listener and
are told the backend and store prefix on joining (see harness/driver/pool.py, Attach).

Every task has a deadline. A rank that raises, exits or hangs fails the task with a RankFailure
that names it and shows its traceback (for a hang, every rank's Python stack) and its captured
output; the world is then torn down and its owner starts a fresh one for the next task.
"""
from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait

from harness.driver import deadlock, disagreement, memory_cgroup, rank_output
from harness.driver.failures import (
    TASK_FAILURES,
    ImplementationIncomplete,
    RankFailure,
    RankReport,
    RanksCrashed,
    RanksDeadlocked,
    RanksHung,
    WorldStartError,
)
from harness.rank import containment, wire
from harness.rank.loop import STACK_DUMP_SIGNAL, RankConfig, ring_path, serve

# torch._dynamo: torch imports it lazily on the first call of a function it decorated, such as the
# first optimizer's constructor, and that import cost each rank about 0.9 s of CPU in its first
# training task (1.4 s under load): 9 s of a 12 s data-parallel mutant run with worlds of 1-4.
# Loaded once in the forkserver, every rank shares it.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "harness.rank.loop", "harness.rank.programs"]
STRAY_CHECK = "harness.rank.programs.probe:stray_messages"
STRAY_CHECK_TIMEOUT_S = 20.0  # every rank is idle by then: the exchange takes milliseconds
STACK_DUMP_WAIT_S = 5.0  # a hung rank writes its stacks in milliseconds; this bounds one that will not
CLOSE_WAIT_S = 1.0  # a rank told to exit leaves at once; one that has not by then is killed


@dataclass
class TaskResult:
    outputs: list  # per rank, what the rank program returned
    logs: list[str]  # per rank, what it printed during the task: its head and tail (harness/driver/rank_output.py)
    records: list = field(default_factory=list)  # per rank, its communication calls (harness/rank/recording.py); [] unless audited
    # per rank, the bytes the kernel saw it write during the task (sockets, pipes, files: /proc/<pid>/io
    # wchar, read by the driver), less its reply to the driver and its captured output; None where
    # not measured (attached ranks, worlds that do not record). The rank cannot lower this count.
    bytes_written: list = field(default_factory=list)
    # per rank, why its count is missing where it should have been measured (a local rank of an
    # audited world), else "": the audit fails on evidence withheld instead of skipping it
    bytes_unread: list = field(default_factory=list)


@dataclass
class _Rank:
    rank: int
    process: multiprocessing.Process | None  # None: attached by a launcher (torchrun), maybe on another host
    log_path: str | None  # None for attached ranks: their output goes to their launcher's console
    conn: Connection | None = None
    # How far into this rank's output the driver has read: every byte it printed, counted whether
    # kept or not (harness/driver/rank_output.py); the audit subtracts a task's share from the
    # kernel's count of bytes the rank wrote (World._run). Its log file may be emptied meanwhile:
    # log_position is where the driver stopped in the file.
    log_offset: int = 0
    log_position: int = 0
    reply_bytes: int = 0  # the last reply's size on the control connection, framing included
    memory: memory_cgroup.MemoryCgroup | None = None  # the memory cgroup it lives in; None: unknown
    oom_kills_before: int | None = None  # that cgroup's OOM kill count when the current task started

    def __post_init__(self):
        # found while the rank is alive: once it died, its /proc entry is gone
        self.memory = None if self.process is None else memory_cgroup.of_process(self.process.pid)
        self.note_oom_kills()

    def note_oom_kills(self) -> None:
        """Note its memory cgroup's OOM kill count now: describe_exit compares (one read of
        memory.oom_control, about 10 us)."""
        self.oom_kills_before = None if self.memory is None else self.memory.oom_kills()

    def killed_for_memory(self) -> bool:
        """It died by SIGKILL and its memory cgroup's OOM kill count rose since the task started:
        the kernel's OOM killer killed it (harness/driver/memory_cgroup.py)."""
        if self.process is None or self.process.exitcode != -signal.SIGKILL or self.oom_kills_before is None:
            return False
        after = self.memory.oom_kills()
        return after is not None and after > self.oom_kills_before

    @property
    def attached(self) -> bool:
        return self.process is None

    def waitables(self) -> list:
        return [self.conn] if self.process is None else [self.conn, self.process.sentinel]

    def has_exited(self) -> bool:
        return self.process is not None and self.process.exitcode is not None

    def describe_exit(self) -> str:
        if self.process is None:
            return "closed its connection to the driver (an attached rank: its launcher's console shows why)"
        self.process.join(timeout=1.0)
        if self.killed_for_memory():
            return memory_cgroup.describe_oom_kill(self.memory.limit())
        return _describe_exit(self.process.exitcode)

    def read_new_output(self) -> str:
        """What the rank printed since the driver last looked: its head and tail, the bytes between
        counted (rank_output.read_new: the driver's memory is bounded whatever a rank prints)."""
        if self.log_path is None:
            return ""
        try:
            text, consumed, self.log_position = rank_output.read_new(self.log_path, self.log_position)
        except FileNotFoundError:
            return ""
        self.log_offset += consumed
        return text

    def begin_task(self) -> None:
        """Before a task: forget what the rank printed between tasks (no test's output), counted but
        not read, its log file emptied past rank_output.LOG_FILE_LIMIT; and note its OOM kill count."""
        if self.log_path is not None:
            try:
                passed, self.log_position = rank_output.pass_over(self.log_path, self.log_position)
                self.log_offset += passed
            except FileNotFoundError:
                pass
        self.note_oom_kills()

    def remove_log(self) -> None:
        """Delete its log file: its world is closed and nobody reads it again (a rank that printed
        1 GiB in its last task would otherwise keep 1 GiB on disk until the session ends)."""
        if self.log_path is not None:
            try:
                os.unlink(self.log_path)
            except FileNotFoundError:
                pass


class World:
    """n rank processes joined in one process group. Use through WorldPool.

    By default the world starts its ranks on this host. Given ``attach_server`` (a listening
    socket the pool owns), it starts nothing and waits for ``size`` ranks that a launcher started
    (``torchrun ... -m harness.rank``, on this host or others) to connect."""

    _ids = itertools.count()

    def __init__(
        self,
        size: int,
        backend: str,
        *,
        store_address: tuple[str, int],
        log_dir: str,
        authkey: bytes,
        start_method: str = "forkserver",
        start_timeout_s: float = 60.0,
        threads_per_rank: int = 1,
        record_communication: bool = False,
        attach_server: socket.socket | None = None,
        contain: bool = False,
        flight_recorder: bool = True,
    ):
        self.size = size
        self.backend = backend
        self.record_communication = record_communication
        self.flight_recorder = flight_recorder
        self.name = f"world{next(self._ids)}-n{size}-{secrets.token_hex(4)}"
        self._authkey = authkey
        self._ranks: list[_Rank] = []
        self._task_ids = itertools.count()
        self._closed = False
        # local ranks run as a user of this world's own (harness/rank/containment.py); swept at close
        self.sandbox = containment.new_sandbox() if contain and attach_server is None else None
        self._counter_reader: containment.CounterReader | None = None  # started on the first read it is needed for
        if attach_server is not None:
            self._attach(attach_server, start_timeout_s)
        else:
            self._start(store_address, log_dir, start_method, start_timeout_s, threads_per_rank)

    # ----------------------------------------------------------------------------------- start
    def _start(self, store_address, log_dir, start_method, start_timeout_s, threads_per_rank):
        context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            context.set_forkserver_preload(PRELOAD)
        server = socket.create_server(("127.0.0.1", 0))
        try:
            for rank in range(self.size):
                log_path = os.path.join(log_dir, f"{self.name}-rank{rank}.log")
                config = RankConfig(
                    rank=rank,
                    world_size=self.size,
                    backend=self.backend,
                    control_address=server.getsockname(),
                    authkey=self._authkey,
                    store_host=store_address[0],
                    store_port=store_address[1],
                    store_prefix=self.name,
                    driver_pid=os.getpid(),
                    log_path=log_path,
                    threads=threads_per_rank,
                    record_communication=self.record_communication,
                    sandbox=self.sandbox,
                    flight_recorder=self.flight_recorder,
                    environment=dict(os.environ),
                )
                process = context.Process(target=serve, args=(config,), name=f"{self.name}-rank{rank}", daemon=True)
                process.start()
                self._ranks.append(_Rank(rank, process, log_path))
            self._accept_all(server, time.monotonic() + start_timeout_s)
            self._await_ready(time.monotonic() + start_timeout_s)
        except BaseException:
            self.close()
            raise
        finally:
            server.close()

    def _attach(self, server: socket.socket, start_timeout_s: float) -> None:
        self._ranks = [_Rank(rank, None, None) for rank in range(self.size)]
        try:
            self._accept_all(server, time.monotonic() + start_timeout_s)
            self._await_ready(time.monotonic() + start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _accept_all(self, server: socket.socket, deadline: float) -> None:
        connected = 0
        while connected < self.size:
            self._raise_if_any_exited("while connecting to the driver")
            if time.monotonic() > deadline:
                missing = [r.rank for r in self._ranks if r.conn is None]
                how = (f"; start them with the command the driver printed (listening on "
                       f"{server.getsockname()[0]}:{server.getsockname()[1]})") if self._ranks[0].attached else ""
                raise WorldStartError(f"{self.name}: only {connected}/{self.size} ranks connected in time "
                                      f"(missing ranks {missing}){how}")
            # a rank dialling in or one dying, whichever comes first (the loop's first line reports a death)
            if server not in wait([server, *self._sentinels()], timeout=max(0.0, deadline - time.monotonic())):
                continue
            try:
                sock, _ = server.accept()
            except (TimeoutError, BlockingIOError):  # the pool's attach listener has a timeout; another took it
                continue
            sock.settimeout(None)
            conn = Connection(sock.detach())
            try:
                deliver_challenge(conn, self._authkey)
                answer_challenge(conn, self._authkey)
                kind, rank, _pid, world_size = wire.decode_untrusted(conn.recv_bytes())
            except Exception:  # noqa: BLE001 - a stranger or a broken rank: drop it, keep waiting
                conn.close()
                continue
            if kind == "hello" and world_size != self.size:
                conn.close()
                raise WorldStartError(f"{self.name}: a rank arrived with WORLD_SIZE={world_size}, but this world has "
                                      f"{self.size} ranks (launch exactly {self.size}, e.g. torchrun --nnodes x "
                                      f"--nproc-per-node with a product of {self.size})")
            if kind != "hello" or not (0 <= rank < self.size) or self._ranks[rank].conn is not None:
                conn.close()
                continue
            self._ranks[rank].conn = conn
            conn.send_bytes(wire.encode_trusted(("join", self.name, self.backend, self.record_communication)))
            connected += 1

    def _await_ready(self, deadline: float) -> None:
        waiting = {r.rank for r in self._ranks}
        while waiting:
            self._raise_if_any_exited("while joining the process group")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorldStartError(f"{self.name}: ranks {sorted(waiting)} did not join the process group in time")
            conns = [self._ranks[r].conn for r in waiting]
            for conn in wait([*conns, *self._sentinels()], timeout=remaining):  # a death: the loop's first line
                if conn not in conns:
                    continue
                try:
                    message = wire.decode_untrusted(conn.recv_bytes())
                except (EOFError, OSError):  # it died (or hung up) after the check above
                    rank = next(r for r in self._ranks if r.conn is conn)
                    raise WorldStartError(f"{self.name}: rank {rank.rank} {rank.describe_exit()} while joining the "
                                          f"process group\n{rank.read_new_output()}") from None
                waiting.discard(message[1])

    def _sentinels(self) -> list[int]:
        """What becomes ready when a local rank dies, so that starting a world waits on events, not a
        polling interval."""
        return [rank.process.sentinel for rank in self._ranks if not rank.attached]

    def _raise_if_any_exited(self, when: str) -> None:
        for rank in self._ranks:
            if rank.has_exited():
                raise WorldStartError(
                    f"{self.name}: rank {rank.rank} {rank.describe_exit()} {when}\n"
                    f"{rank.read_new_output()}"
                )

    # ------------------------------------------------------------------------------------- run
    def run(self, program: str, args_per_rank: list[dict], *, impl: str, timeout_s: float, grace_s: float) -> TaskResult:
        """Run ``program`` on every rank (rank r gets ``args_per_rank[r]``); return every rank's
        output, or raise RankFailure / RanksHung naming the ranks that did not finish. On gloo, a
        task every rank finished is followed by the stray-message check (harness.rank.programs.probe:
        stray_messages): a message the implementation sent and nobody received would otherwise be
        taken by the next test's receive, and blamed on it. Skipped for torch.distributed itself,
        whose collectives send no user-visible point-to-point messages."""
        __tracebackhide__ = True
        result = self._run(program, args_per_rank, impl=impl, timeout_s=timeout_s, grace_s=grace_s)
        if self.backend == "gloo" and self.size > 1 and impl != "torch.distributed":
            self._check_for_stray_messages(program, impl, timeout_s, grace_s)
        return result

    def _check_for_stray_messages(self, program: str, impl: str, timeout_s: float, grace_s: float) -> None:
        __tracebackhide__ = True
        what = f"{program} on {self.size} ranks finished, but the stray-message check after it"
        try:
            check = self._run(STRAY_CHECK, [{}] * self.size, impl=impl, timeout_s=min(timeout_s, STRAY_CHECK_TIMEOUT_S),
                              grace_s=grace_s)
        except TASK_FAILURES as failure:
            self.close()
            inner = failure if isinstance(failure, RankFailure) else failure.failure
            raise RanksCrashed(RankFailure(f"{what} failed: a receive the implementation posted and never matched takes the "
                              f"check's message (the check then hangs), and a leftover message over 64 KiB aborts "
                              f"it; this world is rebuilt for the next test.\n{inner.summary}", inner.ranks)) from None
        leftovers = {rank: out["leftovers"] for rank, out in enumerate(check.outputs) if out["leftovers"]}
        if leftovers:
            self.close()
            found = "; ".join(f"rank {peer} -> rank {rank} (first int64 words {words})"
                              for rank, by_peer in leftovers.items() for peer, words in by_peer.items())
            named = [line for line in self.disagreements({r.rank: "ok" for r in self._ranks}) if "never received" in line]
            found += "".join(f"\n  {line}" for line in named)
            raise RanksCrashed(RankFailure(
                f"{what} found messages the implementation sent and nobody received (tag 0): {found}. "
                "Each would be taken by a later test's receive; this world is rebuilt for the next test.",
                [RankReport(r.rank, "ok", "", "") for r in self._ranks]))

    def _run(self, program: str, args_per_rank: list[dict], *, impl: str, timeout_s: float, grace_s: float) -> TaskResult:
        __tracebackhide__ = True
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        if len(args_per_rank) != self.size:
            raise ValueError(f"{self.name}: {len(args_per_rank)} argument sets for {self.size} ranks")
        task_id = next(self._task_ids)
        written_before = self._kernel_write_counts() if self.record_communication else [None] * self.size
        logged_before = []
        for rank in self._ranks:
            rank.begin_task()  # forget output printed between tasks; note the OOM kill count
            logged_before.append(rank.log_offset)
            rank.conn.send_bytes(wire.encode_trusted(("run", task_id, program, args_per_rank[rank.rank], impl,
                                                      program != STRAY_CHECK)))
        outcome: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + timeout_s
        owners = {}
        for rank in self._ranks:
            for waitable in rank.waitables():
                owners[waitable] = rank
        watch = self._deadlock_watch(task_id)
        while len(outcome) < self.size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            pending = [r for r in self._ranks if r.rank not in outcome]
            for ready in wait([w for r in pending for w in r.waitables()],
                              timeout=remaining if watch is None else watch.timeout(remaining)):
                rank = owners[ready]
                if rank.rank not in outcome:
                    outcome[rank.rank] = self._collect(rank, task_id)
            if any(status != "ok" for status, _ in outcome.values()):
                deadline = min(deadline, time.monotonic() + grace_s)  # peers of a failed rank usually hang
            elif watch is not None and len(outcome) < self.size and watch.check(outcome):
                break  # every rank waits on another and nothing moves: the deadline would add nothing
        if len(outcome) == self.size and all(status == "ok" for status, _ in outcome.values()):
            logs = [r.read_new_output() for r in self._ranks]
            written_after = self._kernel_write_counts() if self.record_communication else [None] * self.size
            written = [None if before is None or after is None else
                       after - before - rank.reply_bytes - (rank.log_offset - logged)
                       for rank, before, after, logged in zip(self._ranks, written_before, written_after, logged_before)]
            unread = [f"rank {rank.rank}: the kernel's count of the bytes it wrote could not be read (its /proc entry "
                      "refused the driver; a rank that makes itself undumpable hides it)"
                      if self.record_communication and not rank.attached and count is None else ""
                      for rank, count in zip(self._ranks, written)]
            return TaskResult([outcome[r][1][0] for r in range(self.size)], logs,
                              [outcome[r][1][1] for r in range(self.size)], written, unread)
        raise self._fail(program, outcome, timeout_s, task_id, watch)

    def _deadlock_watch(self, task_id: int) -> deadlock.Watch | None:
        """A watch that knows a deadlock when it happens (harness/driver/deadlock.py), or None where
        only the deadline can judge: ranks on other hosts (no /proc here), no flight recorder, or
        NCCL (a GPU's work moves none of the counters the watch reads)."""
        if self.backend != "gloo" or not self.flight_recorder or any(r.attached or r.log_path is None
                                                                     for r in self._ranks):
            return None
        return deadlock.Watch([(r.rank, r.process.pid, ring_path(r.log_path)) for r in self._ranks], task_id,
                              read_io=lambda pids: [deadlock.bytes_moved(c) for c in self._io_counters(pids)])

    def _io_counters(self, pids: list[int]) -> list[dict[str, int] | None]:
        """Each process's /proc/<pid>/io counters (None where unreadable), read here or, where the
        driver may not (no CAP_SYS_PTRACE over a contained rank: a container's default capabilities),
        by a reader with the ranks' own uid (containment.CounterReader, one per world)."""
        counters = [deadlock.read_io_counters(pid) for pid in pids]
        unread = [i for i, found in enumerate(counters) if found is None]
        if unread and self.sandbox is not None:
            if self._counter_reader is None:
                self._counter_reader = containment.CounterReader(self.sandbox.uid)
            for i, answer in zip(unread, self._counter_reader.read([pids[i] for i in unread])):
                counters[i] = answer
        return counters

    def _kernel_write_counts(self) -> list[int | None]:
        """Per rank, the kernel's count of the bytes its process has written (/proc/<pid>/io wchar),
        or None for an attached rank or one whose counters cannot be read."""
        pids = [None if r.attached or r.process is None else r.process.pid for r in self._ranks]
        read = dict(zip((p for p in pids if p is not None), self._io_counters([p for p in pids if p is not None])))
        return [None if read.get(pid) is None else read[pid].get("wchar") for pid in pids]

    def _collect(self, rank: _Rank, task_id: int) -> tuple[str, object]:
        if rank.conn.poll():
            try:
                raw = rank.conn.recv_bytes()
                rank.reply_bytes = len(raw) + (4 if len(raw) < 0x7FFFFFFF else 12)  # Connection's length header
                message = wire.decode_untrusted(raw)
            except (EOFError, OSError):
                return "exited", rank.describe_exit()
            except Exception as error:  # noqa: BLE001 - refused by the restricted unpickler
                return "raised", f"the rank sent a result the driver refuses to decode: {error}"
            if message[0] == "done" and message[1] == task_id:
                try:  # the audit's records travel as one JSON string: a tenth of the cost of plain-data pickling
                    records = json.loads(message[3]) if len(message) > 3 and message[3] else []
                except (TypeError, ValueError, RecursionError) as error:
                    return "raised", f"the rank sent communication records the driver cannot read: {error}"
                return "ok", (message[2], records)
            if message[0] == "error":
                return (message[3] if message[3] in ("missing", "broken") else "raised"), message[2]
            return "raised", f"unexpected message from rank: {message[:2]!r}"
        return "exited", rank.describe_exit()

    def disagreements(self, status: dict[int, str]) -> list[str]:
        """What the ranks' flight recorders say about the last task they recorded: the first
        disagreements between their calls (harness/driver/disagreement.py); [] when they agree or cannot
        be read (attached ranks)."""
        calls = {}
        for rank in self._ranks:
            if rank.log_path is None:
                return []
            found = disagreement.read(ring_path(rank.log_path))
            if found is None:
                return []
            calls[rank.rank] = found[1]
        return disagreement.explain(calls, status)

    def _fail(self, program: str, outcome: dict, timeout_s: float, task_id: int,
              watch: deadlock.Watch | None = None) -> BaseException:
        hung = [r for r in self._ranks if r.rank not in outcome]
        self._dump_stacks(hung)
        reports = []
        for rank in self._ranks:
            hung_detail = ("an attached rank: its stacks and output are on its launcher's console" if rank.attached
                           else "its Python stacks (faulthandler) are in its captured output below")
            status, detail = outcome.get(rank.rank, ("hung", hung_detail))
            reports.append(RankReport(rank.rank, status, "" if status == "ok" else str(detail), rank.read_new_output()))
        if hung or any(r.status in ("exited", "broken") for r in reports):
            self.close()  # a rank is gone, stuck or without a process group: the owner starts a fresh world
        failed = [r for r in reports if r.status != "ok"]
        causes = ", ".join(f"rank {r.rank} {r.status}" + (" (out of memory)" if memory_cgroup.OOM_KILLED in r.detail else "")
                           for r in failed)  # on the first line, the one grading summaries show
        lines = [] if all(r.status == "missing" for r in failed) else self.disagreements(
            {r.rank: r.status for r in reports})
        if lines:  # the first disagreement on the first line (the one grading summaries show)
            causes += f"; the ranks disagree: {lines[0]}" + "".join(f"\n  also: {line}" for line in lines[1:])
        if all(r.status == "missing" for r in failed):
            cause = failed[0].detail.strip().splitlines()[-1] if failed[0].detail.strip() else "?"
            return ImplementationIncomplete(RankFailure(f"the implementation under test is incomplete: {cause}", reports))
        if all(r.status == "hung" for r in failed):
            found = watch is not None and watch.found is not None
            why = watch.summary() if found else f"no result within the {timeout_s:g} s deadline"
            return (RanksDeadlocked if found else RanksHung)(RankFailure(f"{program} on {self.size} ranks: {why} ({causes})",
                                                                        reports))
        failure = RankFailure(f"{program} on {self.size} ranks failed: {causes}", reports)
        return RanksCrashed(failure) if self._closed else failure

    @staticmethod
    def _dump_stacks(hung: list[_Rank]) -> None:
        """Every thread's stack of each hung local rank, in its log, complete when this returns.
        A rank dies of STACK_DUMP_SIGNAL once it has written its dump (harness/rank/loop.py), so its
        exit is the event to wait for: a few milliseconds, where a fixed sleep was either too long or,
        under load, too short for the stacks. A rank that has not died within STACK_DUMP_WAIT_S (it
        blocked or replaced the signal) is killed without them. Either way no hung rank is left
        alive, so closing the world does not wait for ranks that cannot answer."""
        local = [rank for rank in hung if not rank.attached]
        for rank in local:
            _signal(rank.process, STACK_DUMP_SIGNAL)
        waiting = {rank.process.sentinel: rank for rank in local}
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while waiting and time.monotonic() < deadline:
            for sentinel in wait(list(waiting), timeout=max(0.0, deadline - time.monotonic())):
                del waiting[sentinel]
        for rank in waiting.values():
            rank.process.kill()

    # ----------------------------------------------------------------------------------- close
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rank in self._ranks:
            if rank.conn is not None:
                try:
                    rank.conn.send_bytes(wire.encode_trusted(("exit",)))
                except OSError:
                    pass
        end = time.monotonic() + CLOSE_WAIT_S  # hung ranks are gone already (_dump_stacks): no wait for them
        local = [rank for rank in self._ranks if not rank.attached]  # attached ranks exit on "exit" or EOF
        for rank in local:
            rank.process.join(timeout=max(0.0, end - time.monotonic()))
        for rank in local:
            if rank.process.is_alive():
                rank.process.kill()
                rank.process.join(timeout=5.0)
        for rank in self._ranks:
            if rank.conn is not None:
                rank.conn.close()
        if self._counter_reader is not None:
            self._counter_reader.close()
        if self.sandbox is not None:
            containment.sweep(self.sandbox)  # whatever the ranks started, detached or not
        for rank in self._ranks:
            rank.remove_log()  # its failure report, if any, was read before the close

    @property
    def closed(self) -> bool:
        return self._closed

    def pids(self) -> list[int]:
        return [r.process.pid for r in self._ranks if not r.attached]


def _signal(process: multiprocessing.Process, signum: int) -> None:
    try:
        os.kill(process.pid, signum)
    except (ProcessLookupError, TypeError):
        pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"
