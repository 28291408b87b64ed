"""Worlds kept for a whole session, one per world size, created on first use. Owned by a pytest
fixture (no module-level state), so Hypothesis can draw the world size freely.

With ``attach=Attach(size, host, port)`` the world of ``size`` ranks is not started here: the pool
listens on host:port (and serves its TCPStore on port+1) and waits for ranks that a launcher
started, on this host or others (:meth:`WorldPool.attach_command` says how). Worlds of other sizes
still run on this host."""

from __future__ import annotations

import secrets
import shutil
import socket
import tempfile
from dataclasses import dataclass

from parallelism_conformance.harness.driver.backends import BackendPlan
from parallelism_conformance.harness.driver.failures import (
    NOT_GRADED,
    TASK_FAILURES,
    BudgetExhausted,
    ContainerMemory,
    RanksDeadlocked,
    RanksHung,
    WorldStartError,
    killed_for_memory,
)
from parallelism_conformance.harness.driver.rank_memory import MemoryBudget
from parallelism_conformance.harness.driver.task_result import TaskResult
from parallelism_conformance.harness.driver.world import World


@dataclass(frozen=True)
class Attach:
    """Where attached ranks find the driver: ``size`` ranks connect to host:port; the store is on
    port+1. ``host`` is the address the ranks dial (``bind`` is where the driver listens)."""

    size: int
    host: str
    port: int
    bind: str = "0.0.0.0"
    timeout_s: float = 300.0


class LiveRanks:
    """A cap on the rank processes kept alive across the pools that share it (the plain and the
    audited pool of a session): a world that would pass it closes the least recently used worlds
    first. Each rank holds its own copy of what torch allocates and what the implementation builds,
    so a memory-limited grader keeps fewer worlds warm and starts some again instead of being
    killed. The cap is the least of ``limit`` (--max-live-ranks as a number) and what ``memory``
    holds of ranks as costly as the largest measured (harness/driver/rank_memory.py); neither: no cap."""

    def __init__(self, limit: int | None = None, memory: MemoryBudget | None = None):
        self.limit = limit
        self.memory = memory
        self._order: list[tuple[WorldPool, int]] = []  # least recently used first

    def cap(self) -> int | None:
        caps = [c for c in (self.limit, None if self.memory is None else self.memory.ranks_that_fit()) if c is not None]
        return min(caps) if caps else None

    def used(self, pool: WorldPool, size: int) -> None:
        key = (pool, size)
        if key in self._order:
            self._order.remove(key)
        self._order.append(key)

    def forget(self, pool: WorldPool, size: int) -> None:
        if (pool, size) in self._order:
            self._order.remove((pool, size))

    def make_room(self, size: int, keep: tuple[WorldPool, int] | None = None) -> None:
        """Close worlds, least recently used first, until ``size`` more ranks fit under the cap
        (``keep``: a live world that is itself the one to run, counted in ``size``)."""
        cap = self.cap()
        if cap is None:
            return
        while True:
            others = [key for key in self._order if key != keep]
            if not others or sum(n for _, n in others) + size <= cap:
                return
            pool, victim = others[0]
            pool.close_world(victim)

    def observe(self, pool: WorldPool, size: int, growths: list[int], where: str) -> None:
        """A task's ranks' measured growth: where it raised the cost of a rank, idle worlds close
        now, before the next task's ranks need the room."""
        if self.memory is None:
            return
        rose = self.memory.observe(growths, where)
        # the base beside the ranks (what the container holds, less theirs): read only where a limit makes
        # it matter, since it costs a memory.stat and every live rank's /proc status after each task
        if self.memory.cgroup is not None and self.memory.limit_bytes is not None:
            private = sum(other_pool.current_private(other) for other_pool, other in self._order)
            rose = self.memory.observe_base(self.memory.cgroup.held(), private) or rose
        if rose:
            self.make_room(size, keep=(pool, size))

    def after_kill(self, pool: WorldPool, size: int, what: str) -> None:
        """The kernel killed a rank for memory: the estimate of a rank rises so that the ranks alive
        then no longer fit, and every other world closes, so the task is rerun with the container
        to itself (a fresh world of ``size``: the killed one is closed)."""
        alive = sum(n for _, n in self._order) + (0 if (pool, size) in self._order else size)
        if self.memory is not None:
            self.memory.note_kill(what)
            self.memory.too_many(alive)
        for other_pool, other in [key for key in self._order if key != (pool, size)]:
            other_pool.close_world(other)


class WorldPool:
    def __init__(
        self,
        backend: str | BackendPlan = "gloo",
        *,
        timeout_s: float = 30.0,
        grace_s: float = 0.5,
        start_method: str = "forkserver",
        store_host: str = "127.0.0.1",
        audit: bool = False,
        threads_per_rank: int = 1,
        attach: Attach | None = None,
        authkey: bytes | None = None,
        on_run=None,
        contain: bool = False,
        time_left=None,
        flight_recorder: bool = True,
        live_ranks: LiveRanks | None = None,
        perturb: bool = False,
        relay: bool = False,
    ):
        self.backend = backend  # one backend for every world, or a BackendPlan: a backend per world size
        self.audit = audit  # ranks record their communication; TaskResult.records carries it
        # worlds that would be gloo's carry point-to-point messages through the driver's relay instead
        # (harness/driver/relay.py): the audit's evidence of a point-to-point implementation
        self.relay = relay
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.start_method = start_method
        self.threads_per_rank = threads_per_rank  # torch intra-op threads in each rank
        self.rebuilds = 0
        self._time_left = time_left  # () -> seconds left of the run's --time-budget; None: no budget
        self.flight_recorder = flight_recorder  # ranks keep their last calls for the failure report
        self.perturb = perturb  # ranks apply a drawn delay schedule per task (harness/rank/perturbation.py)
        self.contain = contain  # local ranks run as a user of their own (harness/rank/containment.py)
        self._on_run = on_run  # called with the world size of every task (the driver's coverage record)
        self.live_ranks = live_ranks or LiveRanks()  # the cap on rank processes kept alive, shared between pools
        self._worlds: dict[int, World] = {}
        self._authkey = authkey or secrets.token_bytes(32)
        self._log_dir = tempfile.mkdtemp(prefix="conformance-ranks-")
        self.attach = attach
        self._attach_server: socket.socket | None = None
        self._attached_lost: str | None = None  # why the attached world is gone for this session
        import torch.distributed as dist

        # One store for the session; each world rendezvouses under its own prefix.
        if attach is None:
            self._store = dist.TCPStore(store_host, 0, is_master=True, wait_for_workers=False)
        else:
            self._attach_server = socket.create_server((attach.bind, attach.port))
            self._attach_server.settimeout(0.2)
            self._store = dist.TCPStore(attach.bind, attach.port + 1, is_master=True, wait_for_workers=False)
            if attach.bind not in ("0.0.0.0", "::", ""):
                store_host = attach.bind  # local ranks of the smaller worlds dial the store where it listens
        self._store_address = (store_host, self._store.port)

    def attach_command(
        self,
        launcher: str = "torchrun --nnodes <hosts> --nproc-per-node <ranks per host> "
        "--node-rank <this host> --master-addr <first host> --master-port <free port>",
    ) -> str:
        """The command that starts the attached ranks (run it from this repository's root on every
        host, with the implementation under test importable there)."""
        if self.attach is None:
            raise ValueError("this pool attaches no ranks")
        env = f"CONFORMANCE_DRIVER={self.attach.host}:{self.attach.port} CONFORMANCE_AUTHKEY={self._authkey.hex()}"
        return f"{env} {launcher} -m parallelism_conformance.harness.rank"

    def backend_for(self, size: int) -> str:
        return self.backend.backend(size) if isinstance(self.backend, BackendPlan) else self.backend

    def world(self, size: int) -> World:
        world = self._worlds.get(size)
        if world is not None:
            self.live_ranks.used(self, size)
            return world
        if not (self.attach is not None and size == self.attach.size):
            self.live_ranks.make_room(size)
        attached = self.attach is not None and size == self.attach.size
        backend = self.backend_for(size)
        if self.relay and backend == "gloo" and not attached:
            backend = "relay"
        if attached and self._attached_lost is not None:
            raise WorldStartError(f"the attached world of {size} ranks is gone: {self._attached_lost}")
        options = dict(attach_server=self._attach_server, start_timeout_s=self.attach.timeout_s) if attached else {}
        try:
            world = self._worlds[size] = World(
                size,
                backend,
                store_address=self._store_address,
                log_dir=self._log_dir,
                authkey=self._authkey,
                start_method=self.start_method,
                threads_per_rank=self.threads_per_rank,
                record_communication=self.audit,
                contain=self.contain,
                flight_recorder=self.flight_recorder,
                perturb=self.perturb,
                **options,
            )
        except WorldStartError as error:
            if attached:
                self._attached_lost = str(error).splitlines()[0]
            raise
        if not attached:
            self.live_ranks.used(self, size)
        return world

    def run(
        self, size: int, program: str, args_per_rank: list[dict], *, impl: str, timeout_s: float | None = None, schedules: list | None = None
    ) -> TaskResult:
        """Run a task on the world of ``size`` ranks. Where the kernel killed one of its ranks for
        memory (the container's limit, not the implementation's doing), the task runs once more
        with every other world closed; killed again, it is ContainerMemory: not graded."""
        __tracebackhide__ = True
        if self._on_run is not None:
            self._on_run(size)
        kills: list[str] = []  # how the kernel's OOM killer ended each attempt
        while True:
            try:
                return self._run_once(size, program, args_per_rank, impl=impl, timeout_s=timeout_s, schedules=schedules)
            except TASK_FAILURES as failure:
                killed = killed_for_memory(failure)
                if not killed:
                    raise
            kills.append(killed)
            if len(kills) == 1:  # the container's, not the implementation's: again, with it to itself
                self.live_ranks.after_kill(self, size, f"{program} on {size} ranks: {killed}")
                continue
            if self.live_ranks.memory is not None:
                self.live_ranks.memory.note_kill(f"{program} on {size} ranks, run alone: {killed}")
            raise ContainerMemory(
                f"{NOT_GRADED}: {program} on {size} ranks: {kills[0]}; run again with every other world closed, "
                f"{kills[1]}. The kernel killed it, not the implementation: this test counts neither for nor "
                "against (a larger memory tier grades it)"
            ) from None

    def _run_once(
        self, size: int, program: str, args_per_rank: list[dict], *, impl: str, timeout_s: float | None, schedules: list | None
    ) -> TaskResult:
        __tracebackhide__ = True
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        cut_by_budget = False
        if self._time_left is not None:
            left = self._time_left()
            if left <= 0:
                raise BudgetExhausted("not run: the run's time budget (--time-budget) is spent")
            cut_by_budget, timeout_s = left < timeout_s, min(timeout_s, left)  # never overrun the budget
        world = self.world(size)
        try:
            result = world.run(
                program,
                args_per_rank,
                impl=impl,
                timeout_s=timeout_s,
                grace_s=self.grace_s,
                schedules=schedules,
            )
        except TASK_FAILURES as failure:
            if world.closed:  # torn down after a hang or exit; the next task starts a fresh world
                self._worlds.pop(size, None)
                self.live_ranks.forget(self, size)
                self.rebuilds += 1
                if self.attach is not None and size == self.attach.size:
                    # attached ranks are not ours to restart: the next task waits for a launcher
                    # (torchrun --max-restarts) to bring them back, once, for attach.timeout_s
                    failure.add_note(
                        f"  the attached world of {size} ranks was torn down; the next task waits "
                        f"{self.attach.timeout_s:g} s for its ranks to reconnect"
                    )
            # the run's time ran out, not the implementation's; a deadlock was found before any deadline
            if isinstance(failure, RanksHung) and not isinstance(failure, RanksDeadlocked) and cut_by_budget:
                raise BudgetExhausted(
                    f"not finished: the run's time budget (--time-budget) ran out during this task, {timeout_s:.3g} s after it started"
                ) from None
            raise
        self.live_ranks.observe(self, size, world.growths(), f"{program} on {size} ranks")
        return result

    def current_private(self, size: int) -> int:
        """What the live world of ``size`` ranks holds of its own now (World.current_private), 0 if none."""
        world = self._worlds.get(size)
        return 0 if world is None else world.current_private()

    def disagreements(self, size: int) -> list[str]:
        """The flight recorders' account of the last task on the world of ``size`` ranks, if it is
        still up (every rank finished it: statuses "ok")."""
        world = self._worlds.get(size)
        return [] if world is None else world.disagreements({rank: "ok" for rank in range(size)})

    def close_world(self, size: int) -> None:
        self.live_ranks.forget(self, size)
        world = self._worlds.pop(size, None)
        if world is not None:
            world.close()

    def close(self) -> None:
        for size, world in self._worlds.items():
            self.live_ranks.forget(self, size)
            world.close()
        self._worlds.clear()
        if self._attach_server is not None:
            self._attach_server.close()
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
