"""The live-rank cap from what ranks cost running (harness/driver/rank_memory.py, pool.LiveRanks):
the kernel's figures parsed, the estimate only rising, idle worlds closed when it rises, and every
other world closed after a kill. Pure: fake pools, no rank started."""

from __future__ import annotations

import os

from parallelism_conformance.harness.driver import rank_memory
from parallelism_conformance.harness.driver.pool import LiveRanks
from parallelism_conformance.harness.driver.rank_memory import DRIVER_BYTES, FIRST_RANK_BYTES, IDLE_RANK_BYTES, MemoryBudget

MiB = 1 << 20
STATUS = "Name:\tpython\nVmPeak:\t 900000 kB\nVmHWM:\t  512000 kB\nVmRSS:\t  256000 kB\nRssAnon:\t  200000 kB\nRssFile:\t 56000 kB\n"


def test_the_kernels_figures_are_read_in_bytes():
    assert rank_memory.status_bytes(STATUS, "VmHWM") == 512000 * 1024
    assert rank_memory.status_bytes(STATUS, "RssAnon") == 200000 * 1024
    assert rank_memory.status_bytes(STATUS, "VmSwap") is None
    peak, now, anon = rank_memory.read_status(os.getpid())
    assert peak >= now > 0 and 0 < anon <= now
    assert rank_memory.read_status(2**22 + 12345) is None  # no such process


def test_a_ranks_growth_counts_anonymous_memory_and_the_peak_above_now():
    cost = rank_memory.RankCost(os.getpid())
    cost.note_join()
    held = bytearray(64 * MiB)  # anonymous, touched: counted
    grown = cost.growth()
    assert grown >= 60 * MiB and cost.last_peak is not None
    del held


class FakePool:
    def __init__(self, live: LiveRanks):
        self.live, self.closed = live, []

    def close_world(self, size: int) -> None:
        self.closed.append(size)
        self.live.forget(self, size)


def test_the_cap_falls_as_larger_ranks_are_measured_and_idle_worlds_close_at_once():
    budget = MemoryBudget(1536 * MiB)
    live = LiveRanks(memory=budget)
    assert live.cap() == (1536 * MiB - DRIVER_BYTES) // FIRST_RANK_BYTES  # the first estimate
    pool = FakePool(live)
    for size in (1, 2, 3):
        live.used(pool, size)
    live.observe(pool, 3, [40 * MiB], "small")  # lighter than the first estimate: nothing changes
    assert budget.rank_bytes() == FIRST_RANK_BYTES and pool.closed == []
    live.observe(pool, 3, [300 * MiB - IDLE_RANK_BYTES, 10 * MiB], "data_parallel on 3 ranks")
    assert budget.rank_bytes() == 300 * MiB and live.cap() == (1536 * MiB - DRIVER_BYTES) // (300 * MiB) == 3
    assert pool.closed == [1, 2]  # the world that ran stays; the others make room
    live.observe(pool, 3, [100 * MiB], "lighter again")
    assert budget.rank_bytes() == 300 * MiB  # never lowered: the largest seen stands
    assert "at most 3 live ranks of 300 MiB each" in budget.describe() and "data_parallel on 3 ranks" in budget.describe()


def test_a_kill_closes_every_other_world_and_one_fewer_rank_fits_from_then_on():
    budget = MemoryBudget(1536 * MiB)
    live = LiveRanks(memory=budget)
    pool, other = FakePool(live), FakePool(live)
    live.used(pool, 2), live.used(other, 4), live.used(pool, 1)  # 7 ranks alive, then a rank of 4 dies
    live.forget(other, 4)  # the killed world was closed by its pool
    live.after_kill(other, 4, "train on 4 ranks: rank 3 was killed")
    assert pool.closed == [2, 1] and budget.kills == ["train on 4 ranks: rank 3 was killed"]
    assert live.cap() == 6 and "raised after a kill with 7 ranks alive" in budget.describe()


def test_no_limit_keeps_every_world_and_a_number_caps_too():
    assert LiveRanks(memory=MemoryBudget(None)).cap() is None
    assert LiveRanks(5, MemoryBudget(None)).cap() == 5
    assert LiveRanks(5, MemoryBudget(600 * MiB)).cap() == 1  # one world always runs: the cap never refuses a task


def _adj(pid: int) -> int:
    with open(f"/proc/{pid}/oom_score_adj") as file:
        return int(file.read())


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as file:
        return int(file.read().rsplit(")", 1)[1].split()[1])


def test_the_oom_killer_takes_ranks_and_the_forkserver_never_the_driver_first():
    from parallelism_conformance.harness.driver.pool import WorldPool

    with WorldPool("gloo") as pool:
        (rank,) = pool.world(1).pids()
        forkserver = _parent(rank)
        assert (_adj(rank), _adj(forkserver)) == (1000, 1000)
        assert _adj(os.getpid()) < 1000  # this process, the driver: last in line


def test_the_base_beside_the_ranks_is_what_the_container_cannot_reclaim_less_theirs():
    from parallelism_conformance.harness.driver import memory_cgroup

    v1 = "cache 900\nrss 5\ntotal_cache 4096000\ntotal_rss 700\ntotal_mapped_file 200\ntotal_shmem 100\n"
    assert memory_cgroup.held(v1, 1) == 1000  # page cache nobody maps is reclaimed first: left out
    assert memory_cgroup.held("anon 600\nfile 90000\nfile_mapped 300\nshmem 0\n", 2) == 900
    assert memory_cgroup.held("anon 600\n", 2) is None
    budget = MemoryBudget(1536 * MiB)
    assert budget.ranks_that_fit() == (1536 - 450) // 128  # the first estimate against the calibrated driver
    budget.observe([168 * MiB - IDLE_RANK_BYTES], "heavy")
    assert budget.ranks_that_fit() == (1536 - 450) // 168
    assert budget.observe_base(1400 * MiB, 800 * MiB)  # 600 MiB held beside the ranks: one fewer fits
    assert budget.ranks_that_fit() == (1536 - 600) // 168 and "beside 600 MiB" in budget.describe()
    assert not budget.observe_base(1000 * MiB, 800 * MiB)  # the base never falls
    light = MemoryBudget(1536 * MiB, base_bytes=600 * MiB)
    light.observe([51 * MiB], "light")  # measured lighter than the first estimate: the calibrated cap stands
    assert light.ranks_that_fit() == (1536 - 450) // 128
