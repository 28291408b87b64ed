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
import multiprocessing
import os
import pickle
import secrets
import socket
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait

from parallelism_conformance.harness.driver import deadlock, disagreement, memory_cgroup, output_pipe, relay, relay_verdicts, stray_messages
from parallelism_conformance.harness.driver.failures import RankFailure, RankReport, RanksCrashed, WorldStartError, task_failure
from parallelism_conformance.harness.driver.io_counters import IoCounters
from parallelism_conformance.harness.driver.rank_handle import RankHandle, dump_stacks
from parallelism_conformance.harness.driver.stray_messages import STRAY_CHECK
from parallelism_conformance.harness.driver.task_result import TaskResult, collect
from parallelism_conformance.harness.rank import containment, wire
from parallelism_conformance.harness.rank.loop import RankConfig, ring_path, serve
from parallelism_conformance.harness.rank.preload import with_library_modules

CLOSE_WAIT_S = 1.0
JOIN_MESSAGE_LIMIT = (
    1 << 16
)  # "hello" and "ready" are a few tuples of numbers: bounded like every reply  # a rank told to exit leaves at once; one that has not by then is killed


class World:
    """n rank processes joined in one process group. Use through WorldPool.

    By default the world starts its ranks on this host. Given ``attach_server`` (a listening
    socket the pool owns), it starts nothing and waits for ``size`` ranks that a launcher started
    (``torchrun ... -m parallelism_conformance.harness.rank``, on this host or others) to connect."""

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
        perturb: bool = False,
    ):
        self.size = size
        self.perturb = perturb  # its ranks apply a delay schedule per task (harness/rank/perturbation.py)
        self.backend = backend
        self.record_communication = record_communication
        self.flight_recorder = flight_recorder
        self.name = f"world{next(self._ids)}-n{size}-{secrets.token_hex(4)}"
        self._authkey = authkey
        self._ranks: list[RankHandle] = []
        self._task_ids = itertools.count()
        self._closed = False
        # local ranks run as a user of this world's own (harness/rank/containment.py); swept at close
        self.sandbox = containment.new_sandbox() if contain and attach_server is None else None
        self._counters = IoCounters(self.sandbox)
        self._pump: output_pipe.Pump | None = None  # drains the local ranks' output (harness/driver/output_pipe.py)
        self._reply_limit = wire.reply_limit(memory_cgroup.own_limit(), size)
        # a relay world's only transport, and the audit's evidence (harness/driver/relay.py)
        self.relay = relay.Relay(size, budget=min(relay.BUDGET, self._reply_limit * (size + 2))) if backend == "relay" else None
        if attach_server is not None:
            self._attach(attach_server, start_timeout_s)
        else:
            self._start(store_address, log_dir, start_method, start_timeout_s, threads_per_rank)

    # ----------------------------------------------------------------------------------- start
    def _start(self, store_address, log_dir, start_method, start_timeout_s, threads_per_rank):
        context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            context.set_forkserver_preload(with_library_modules(dict(os.environ)))
        server = socket.create_server(("127.0.0.1", 0))
        try:
            for rank in range(self.size):
                log_path = os.path.join(log_dir, f"{self.name}-rank{rank}.log")
                pipe = output_pipe.RankPipe(log_path)  # made before the rank, which opens it at its start
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
                self._ranks.append(RankHandle(rank, process, log_path, pipe=pipe))
            self._pump = output_pipe.Pump([r.pipe for r in self._ranks])
            self._accept_all(server, time.monotonic() + start_timeout_s)
            self._await_ready(time.monotonic() + start_timeout_s)
        except BaseException:
            self.close()
            raise
        finally:
            server.close()

    def _attach(self, server: socket.socket, start_timeout_s: float) -> None:
        self._ranks = [RankHandle(rank, None, None) for rank in range(self.size)]
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
                how = (
                    (f"; start them with the command the driver printed (listening on {server.getsockname()[0]}:{server.getsockname()[1]})")
                    if self._ranks[0].attached
                    else ""
                )
                raise WorldStartError(f"{self.name}: only {connected}/{self.size} ranks connected in time (missing ranks {missing}){how}")
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
                kind, rank, _pid, world_size = wire.decode_untrusted(conn.recv_bytes(maxlength=JOIN_MESSAGE_LIMIT))
            except Exception:  # noqa: BLE001 - a stranger or a broken rank: drop it, keep waiting
                conn.close()
                continue
            if kind == "hello" and world_size != self.size:
                conn.close()
                raise WorldStartError(
                    f"{self.name}: a rank arrived with WORLD_SIZE={world_size}, but this world has "
                    f"{self.size} ranks (launch exactly {self.size}, e.g. torchrun --nnodes x "
                    f"--nproc-per-node with a product of {self.size})"
                )
            if kind != "hello" or not (0 <= rank < self.size) or self._ranks[rank].conn is not None:
                conn.close()
                continue
            self._ranks[rank].conn = conn
            joins = self.relay.join_info(rank) if self.relay is not None else None
            conn.send_bytes(wire.encode_trusted(("join", self.name, self.backend, self.record_communication, self.perturb, joins)))
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
                    message = wire.decode_untrusted(conn.recv_bytes(maxlength=JOIN_MESSAGE_LIMIT))
                    if not (isinstance(message, tuple) and len(message) > 1 and message[1] in range(self.size)):
                        raise ValueError(f"not a rank's ready message: {type(message).__name__}")
                except (ValueError, pickle.UnpicklingError) as error:  # refused by the bounded decoder, or of another shape
                    raise WorldStartError(f"{self.name}: a rank sent a ready message the driver refuses: {error}") from None
                except (EOFError, OSError):  # it died (or hung up) after the check above
                    rank = next(r for r in self._ranks if r.conn is conn)
                    raise WorldStartError(
                        f"{self.name}: rank {rank.rank} {rank.describe_exit()} while joining the process group\n{rank.read_new_output()}"
                    ) from None
                waiting.discard(message[1])
                self._ranks[message[1]].joined(message)

    def _sentinels(self) -> list[int]:
        """What becomes ready when a local rank dies, so that starting a world waits on events, not a
        polling interval."""
        return [rank.process.sentinel for rank in self._ranks if not rank.attached]

    def _raise_if_any_exited(self, when: str) -> None:
        for rank in self._ranks:
            if rank.has_exited():
                raise WorldStartError(f"{self.name}: rank {rank.rank} {rank.describe_exit()} {when}\n{rank.read_new_output()}")

    # ------------------------------------------------------------------------------------- run
    def run(self, program: str, args_per_rank: list[dict], *, impl: str, timeout_s: float, grace_s: float, schedules=None) -> TaskResult:
        """Run ``program`` on every rank (rank r gets ``args_per_rank[r]``); return every rank's
        output, or raise RankFailure / RanksHung naming the ranks that did not finish (``schedules``:
        each rank's --perturb-timing delays). On gloo, a task every rank finished is followed by the
        stray-message check (harness.rank.programs.probe: stray_messages): a message the
        implementation sent and nobody received would otherwise be taken by the next test's receive,
        and blamed on it. Skipped for torch.distributed, whose collectives send no user-visible one."""
        __tracebackhide__ = True
        result = self._run(program, args_per_rank, impl=impl, timeout_s=timeout_s, grace_s=grace_s, schedules=schedules)
        if self.backend == "gloo" and self.size > 1 and impl != "torch.distributed":
            stray_messages.check(self, program, impl, timeout_s, grace_s)
        if result.relayed is not None:
            relay_verdicts.check_strays(self, program, result.relayed)
        return result

    def _run(self, program: str, args_per_rank: list[dict], *, impl: str, timeout_s: float, grace_s: float, schedules=None) -> TaskResult:
        __tracebackhide__ = True
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        if len(args_per_rank) != self.size:
            raise ValueError(f"{self.name}: {len(args_per_rank)} argument sets for {self.size} ranks")
        task_id = next(self._task_ids)
        self._raise_if_died_idle(program)
        written_before = self._counters.sent(self._ranks) if self.record_communication else [None] * self.size
        logged_before = []
        for rank in self._ranks:
            rank.begin_task()  # forget output printed between tasks; note the OOM kill count
            logged_before.append(rank.log_offset)
            rank.conn.send_bytes(
                wire.encode_trusted(
                    ("run", task_id, program, args_per_rank[rank.rank], impl, program != STRAY_CHECK, schedules and schedules[rank.rank])
                )
            )
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
            for ready in wait([w for r in pending for w in r.waitables()], timeout=remaining if watch is None else watch.timeout(remaining)):
                rank = owners[ready]
                if rank.rank not in outcome:
                    outcome[rank.rank] = collect(rank, task_id, self._reply_limit, self.size)
            if any(status != "ok" for status, _ in outcome.values()):
                deadline = min(deadline, time.monotonic() + grace_s)  # peers of a failed rank usually hang
            elif watch is not None and len(outcome) < self.size and watch.check(outcome):
                break  # every rank waits on another and nothing moves: the deadline would add nothing
        if len(outcome) == self.size and all(status == "ok" for status, _ in outcome.values()):
            logs = [r.read_new_output() for r in self._ranks]
            written_after = self._counters.sent(self._ranks) if self.record_communication else [None] * self.size
            written = [
                None if before is None or after is None else after - before - rank.reply_bytes - (rank.log_offset - logged)
                for rank, before, after, logged in zip(self._ranks, written_before, written_after, logged_before)
            ]
            unread = [
                self._counters.why_unread(rank) if self.record_communication and count is None else ""
                for rank, count in zip(self._ranks, written)
            ]
            for rank in self._ranks:
                rank.note_oom_kills()  # a kill from now until the next task was while it was idle
            relayed = self.relay.take() if self.relay is not None else None
            return TaskResult(
                [outcome[r][1][0] for r in range(self.size)],
                logs,
                [outcome[r][1][1] for r in range(self.size)],
                written,
                unread,
                [outcome[r][1][2] for r in range(self.size)],
                relayed,
            )
        raise self._fail(program, outcome, timeout_s, task_id, watch)

    def _raise_if_died_idle(self, program: str) -> None:
        """A rank that died between tasks (the kernel's OOM killer takes the largest rank of the
        container, often one of an idle world) fails this task before it starts, its death described
        as it was: the pool reruns a task whose rank was killed for memory (pool.py)."""
        dead = [rank for rank in self._ranks if rank.has_exited()]
        if not dead:
            return
        reports = [
            RankReport(r.rank, "exited", f"{r.describe_exit()}, between tasks, before this one started", r.read_new_output())
            if r in dead
            else RankReport(r.rank, "ok")
            for r in self._ranks
        ]
        self.close()
        names = ", ".join(f"rank {r.rank} {r.detail}" for r in reports if r.status != "ok")
        raise RanksCrashed(RankFailure(f"{program} on {self.size} ranks not started: {names}", reports))

    def current_private(self) -> int:
        """What its local ranks hold of their own now (rank_memory.RankCost.current), summed."""
        return sum(rank.cost.current() for rank in self._ranks if rank.cost is not None)

    def growths(self) -> list[int]:
        """How far each local rank's resident set has peaked above its size at join (the kernel's
        high-water mark: harness/driver/rank_memory.py), for the ranks where it can be read."""
        found = [rank.cost.growth() for rank in self._ranks if rank.cost is not None]
        return [g for g in found if g is not None]

    def _deadlock_watch(self, task_id: int) -> deadlock.Watch | None:
        """A watch that knows a deadlock when it happens (harness/driver/deadlock.py), or None where
        only the deadline can judge: ranks on other hosts (no /proc here), no flight recorder, or
        NCCL (a GPU's work moves none of the counters the watch reads)."""
        if self.backend != "gloo" or not self.flight_recorder or any(r.attached or r.log_path is None for r in self._ranks):
            return None
        return deadlock.Watch(
            [(r.rank, r.process.pid, ring_path(r.log_path)) for r in self._ranks],
            task_id,
            read_io=lambda pids: [deadlock.bytes_moved(c) for c in self._counters.read(pids)],
        )

    def disagreements(self, status: dict[int, str]) -> list[str]:
        """What the ranks' flight recorders say about the last task they recorded (disagreement.py)."""
        return disagreement.from_flight_recorders({r.rank: r.log_path and ring_path(r.log_path) for r in self._ranks}, status)

    def _fail(self, program: str, outcome: dict, timeout_s: float, task_id: int, watch: deadlock.Watch | None = None) -> BaseException:
        hung = [r for r in self._ranks if r.rank not in outcome]
        dump_stacks(hung)
        reports = []
        for rank in self._ranks:
            hung_detail = (
                "an attached rank: its stacks and output are on its launcher's console"
                if rank.attached
                else "its Python stacks (faulthandler) are in its captured output below"
            )
            status, detail = outcome.get(rank.rank, ("hung", hung_detail))
            reports.append(RankReport(rank.rank, status, "" if status == "ok" else str(detail), rank.read_new_output()))
        if hung or any(r.status in ("exited", "broken") for r in reports):
            self.close()  # a rank is gone, stuck or without a process group: the owner starts a fresh world
        failed = [r for r in reports if r.status != "ok"]
        lines = [] if all(r.status in ("missing", "unloadable") for r in failed) else self.disagreements({r.rank: r.status for r in reports})
        deadlock_found = watch.summary() if watch is not None and watch.found is not None else None
        return task_failure(f"{program} on {self.size} ranks", reports, lines, timeout_s, deadlock_found, world_closed=self._closed)

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
        end = time.monotonic() + CLOSE_WAIT_S  # hung ranks are gone already (dump_stacks): no wait for them
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
        self._counters.close()
        if self.relay is not None:
            self.relay.close()
        if self._pump is not None:
            self._pump.close()
        if self.sandbox is not None:
            containment.sweep(self.sandbox)  # whatever the ranks started, detached or not
        for rank in self._ranks:
            rank.remove_log()  # its failure report, if any, was read before the close

    @property
    def closed(self) -> bool:
        return self._closed

    def pids(self) -> list[int]:
        return [r.process.pid for r in self._ranks if not r.attached]
