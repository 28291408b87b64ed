"""Worlds kept for a whole session, one per world size, created on first use. Owned by a pytest
fixture (no module-level state), so Hypothesis can draw the world size freely."""
from __future__ import annotations

import secrets
import shutil
import tempfile

from harness.failures import ImplementationIncomplete, RankFailure, RanksHung
from harness.world import TaskResult, World


class WorldPool:
    def __init__(
        self,
        backend: str = "gloo",
        *,
        timeout_s: float = 30.0,
        grace_s: float = 0.5,
        start_method: str = "forkserver",
        store_host: str = "127.0.0.1",
        audit: bool = False,
        threads_per_rank: int = 1,
    ):
        self.backend = backend
        self.audit = audit  # ranks record their communication; TaskResult.records carries it
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.start_method = start_method
        self.threads_per_rank = threads_per_rank  # torch intra-op threads in each rank
        self.rebuilds = 0
        self._worlds: dict[int, World] = {}
        self._authkey = secrets.token_bytes(32)
        self._log_dir = tempfile.mkdtemp(prefix="conformance-ranks-")
        import torch.distributed as dist

        # One store for the session; each world rendezvouses under its own prefix.
        self._store = dist.TCPStore(store_host, 0, is_master=True, wait_for_workers=False)
        self._store_address = (store_host, self._store.port)

    def world(self, size: int) -> World:
        world = self._worlds.get(size)
        if world is None:
            world = self._worlds[size] = World(
                size,
                self.backend,
                store_address=self._store_address,
                log_dir=self._log_dir,
                authkey=self._authkey,
                start_method=self.start_method,
                threads_per_rank=self.threads_per_rank,
                record_communication=self.audit,
            )
        return world

    def run(self, size: int, program: str, args_per_rank: list[dict], *, impl: str, timeout_s: float | None = None) -> TaskResult:
        __tracebackhide__ = True
        world = self.world(size)
        try:
            return world.run(
                program,
                args_per_rank,
                impl=impl,
                timeout_s=self.timeout_s if timeout_s is None else timeout_s,
                grace_s=self.grace_s,
            )
        except (RankFailure, RanksHung, ImplementationIncomplete):
            if world.closed:  # torn down after a hang or exit; the next task starts a fresh world
                self._worlds.pop(size, None)
                self.rebuilds += 1
            raise

    def close_world(self, size: int) -> None:
        world = self._worlds.pop(size, None)
        if world is not None:
            world.close()

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
