"""Issue 27: a grading container has a memory limit. The driver keeps a bounded head and tail of
what a rank prints (ranks of a correct all_reduce that printed 1 GiB each got the driver OOM-killed
in a 3 GiB container, results.json holding 0 tests), the log files on disk stay bounded, and a rank
the kernel's out-of-memory killer killed is reported as that, not as "killed by SIGKILL"."""

from __future__ import annotations

import io
import json
import os
import secrets
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from parallelism_conformance.harness.driver import memory_cgroup, rank_output
from parallelism_conformance.harness.driver.failures import RankReport, RanksCrashed
from parallelism_conformance.harness.driver.pool import WorldPool
from parallelism_conformance.harness.driver.rank_handle import RankHandle

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
CALL = "parallelism_conformance.harness.rank.programs.collectives:call"
MiB = 1 << 20


def all_reduce_task(n: int) -> list[dict]:
    return [{"function": "all_reduce", "arguments": {"tensor": torch.full((4,), float(r + 1)), "op": "SUM"}, "group": None} for r in range(n)]


def chatty_impl(folder: Path, bytes_per_call: int, calls: int = 0, then: str = "") -> str:
    """An implementation file: tests/fixtures/chatty_impl.py printing ``bytes_per_call`` on each of
    its first ``calls`` calls (0: every call), then running ``then`` (a statement) before reducing.
    A file of its own, not the fixture's environment variables: the forkserver's environment is
    the one of the first pool this pytest process started."""
    path = folder / f"chatty_{bytes_per_call}_{calls}_{secrets.token_hex(3)}.py"
    path.write_text(
        f"import sys\nsys.path.insert(0, {str(FIXTURES)!r})\nimport chatty_impl\n"
        f"chatty_impl.BYTES, chatty_impl.CALLS = {bytes_per_call}, {calls}\n"
        "from chatty_impl import *\n"
        "import torch.distributed as dist\n"
        "def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):\n"
        "    chatty_impl._chatter()\n"
        f"    {then or 'pass'}\n"
        "    return chatty_impl.impls.all_reduce(tensor, op=op, group=group, async_op=async_op)\n"
    )
    return str(path)


class CountingReads(io.BytesIO):
    """A file that counts the bytes read from it."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.bytes_read = 0

    def read(self, size=-1):
        data = super().read(size)
        self.bytes_read += len(data)
        return data


# ---------------------------------------------------------------------------------- the reader
def test_a_long_output_keeps_its_head_and_tail_and_counts_every_byte_reading_only_what_it_keeps():
    data = b"first line\n" + b"m" * (10 * MiB) + b"\nlast line\n"
    log = CountingReads(data)
    text, consumed = rank_output.read_bounded(log, 0, len(data))
    assert consumed == len(data)
    assert log.bytes_read == rank_output.HEAD_BYTES + rank_output.TAIL_BYTES
    assert text.startswith("first line\n") and text.endswith("\nlast line\n")
    left_out = len(data) - rank_output.HEAD_BYTES - rank_output.TAIL_BYTES
    assert f"\n[... {left_out} bytes of this rank's output left out ...]\n" in text


def test_a_short_output_is_whole_even_with_a_character_split_where_head_and_tail_meet():
    data = "é" * 10  # two bytes each: a 5-byte head ends inside one
    text, consumed = rank_output.read_bounded(io.BytesIO(data.encode()), 0, 20, head_bytes=5, tail_bytes=15)
    assert (text, consumed) == (data, 20)


def test_a_log_that_ends_early_counts_only_what_it_held():
    text, consumed = rank_output.read_bounded(io.BytesIO(b"abc"), 0, 100, head_bytes=10, tail_bytes=10)
    assert (text, consumed) == ("abc", 3)


def test_a_report_cut_shorter_still_says_how_many_bytes_are_not_shown():
    text, _ = rank_output.read_bounded(io.BytesIO(b"a" * 100 + b"b" * 1000 + b"c" * 100), 0, 1200, 100, 100)
    short = rank_output.shorten(text, 10, 20)
    assert short == "a" * 10 + rank_output.left_out(90 + 1000 + 80) + "c" * 20
    assert rank_output.shorten("é" * 50, 5, 5) == "é" * 5 + rank_output.left_out(80) + "é" * 5  # UTF-8 bytes
    assert rank_output.shorten("short", 10, 20) == "short"


def test_a_failure_report_shows_the_start_and_the_end_of_a_long_output():
    output = "the first warning\n" + "noise\n" * 100_000 + "Traceback: the last error\n"
    rendered = RankReport(1, "raised", "ValueError", output).render()
    assert "the first warning" in rendered and "Traceback: the last error" in rendered
    assert "bytes of this rank's output left out" in rendered and len(rendered) < 6000


def test_a_log_past_the_limit_is_emptied_when_the_next_task_starts_and_appends_go_on_at_its_start(tmp_path):
    path = tmp_path / "rank.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # as harness/rank/loop.py opens it
    try:
        os.write(fd, b"q" * 100)
        assert rank_output.pass_over(str(path), 0) == (100, 100)  # small: left whole
        os.write(fd, b"x" * (rank_output.LOG_FILE_LIMIT + 1))
        assert rank_output.pass_over(str(path), 100) == (rank_output.LOG_FILE_LIMIT + 1, 0)
        assert path.stat().st_size == 0
        os.write(fd, b"after")  # O_APPEND: at the new end, no hole of zeros before it
        assert path.read_bytes() == b"after"
        assert rank_output.read_new(str(path), 0) == ("after", 5, 5)
    finally:
        os.close(fd)


def test_a_log_the_rank_emptied_itself_is_read_from_its_start(tmp_path):
    path = tmp_path / "rank.log"
    path.write_bytes(b"new")
    assert rank_output.read_new(str(path), 1000) == ("new", 3, 3)


# ----------------------------------------------------------------------- worlds of chatty ranks
def test_a_chatty_rank_is_counted_exactly_kept_bounded_and_its_log_emptied_then_removed(tmp_path):
    printed = 3 * MiB + 17
    with WorldPool("gloo", timeout_s=60.0, audit=True) as pool:
        quiet = pool.run(2, CALL, all_reduce_task(2), impl="parallelism_conformance.impls")
        result = pool.run(2, CALL, all_reduce_task(2), impl=chatty_impl(tmp_path, printed, calls=1))
        world = pool.world(2)
        assert [out["tensor"].tolist() for out in result.outputs] == [[3.0] * 4] * 2
        assert all(len(log) < rank_output.HEAD_BYTES + rank_output.TAIL_BYTES + 100 for log in result.logs)
        left_out = printed - rank_output.HEAD_BYTES - rank_output.TAIL_BYTES
        assert all(f"[... {left_out} bytes of this rank's output left out ...]" in log for log in result.logs)
        # the audit's count subtracts the captured output: exact, so the chatty task's unexplained
        # bytes are those of the quiet one (the same messages), not 3 MiB more or less
        assert all(abs(loud - calm) < 256 for loud, calm in zip(result.bytes_written, quiet.bytes_written)), (
            result.bytes_written,
            quiet.bytes_written,
        )
        logs = [rank.log_path for rank in world._ranks]
        pool.run(2, CALL, all_reduce_task(2), impl="parallelism_conformance.impls")  # the gloo stray check ran already: emptied
        assert all(os.path.getsize(path) == 0 for path in logs)
    assert not any(os.path.exists(path) for path in logs)  # a closed world's logs are gone


def test_a_chatty_rank_that_fails_is_reported_with_its_last_lines_and_the_count_left_out(tmp_path):
    impl = chatty_impl(tmp_path, 2 * MiB, then="print('the end of rank', dist.get_rank()); assert dist.get_rank() == 0, 'loud'")
    with WorldPool("gloo", timeout_s=10.0) as pool:
        with pytest.raises(RanksCrashed) as caught:  # rank 1 raised, rank 0 hung in the all_reduce
            pool.run(2, CALL, all_reduce_task(2), impl=impl)
    message = str(caught.value)
    assert "AssertionError: loud" in message and "the end of rank 1" in message
    assert "bytes of this rank's output left out" in message and len(message) < 30_000


# ------------------------------------------------------------------------- the OOM killer's count
V1_PROC_CGROUP = "9:name=systemd:/\n4:memory:/docker/abc\n3:cpuset:/\n0::/\n"
V1_MOUNTINFO = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)
V2_MOUNTINFO = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_the_memory_cgroup_is_found_on_v1_v2_and_a_containers_view():
    assert memory_cgroup.memory_paths(V1_PROC_CGROUP) == {1: "/docker/abc", 2: "/"}
    assert memory_cgroup.locate(V1_PROC_CGROUP, V1_MOUNTINFO).directory == "/sys/fs/cgroup/memory"  # the mount shows /docker/abc
    deeper = memory_cgroup.locate("4:memory:/docker/abc/ranks\n", V1_MOUNTINFO)
    assert (deeper.directory, deeper.version) == ("/sys/fs/cgroup/memory/ranks", 1)
    v2 = memory_cgroup.locate("0::/user.slice/grader\n", V2_MOUNTINFO)
    assert (v2.directory, v2.version, v2.mount_point) == ("/sys/fs/cgroup/user.slice/grader", 2, "/sys/fs/cgroup")
    assert memory_cgroup.locate("4:memory:/elsewhere\n", V1_MOUNTINFO) is None  # not under the mount's root
    assert memory_cgroup.locate("0::/\n", "") is None
    spaced = memory_cgroup.memory_mounts("35 31 0:32 / /sys/fs/cg\\040x rw - cgroup cgroup rw,memory\n")
    assert spaced[0].mount_point == "/sys/fs/cg x"


def test_the_oom_kill_count_and_the_limit_are_read_from_the_cgroups_files():
    assert memory_cgroup.oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n") == 3
    assert memory_cgroup.oom_kills("low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n") == 1
    assert memory_cgroup.oom_kills("oom_kill_disable 0\nunder_oom 0\n") is None  # before Linux 4.13
    assert memory_cgroup.v1_limit("cache 0\nhierarchical_memory_limit 1610612736\n") == 1536 * MiB
    assert memory_cgroup.v1_limit("hierarchical_memory_limit 9223372036854771712\n") is None
    assert memory_cgroup.v2_limit(["max\n", "3221225472\n", "4294967296\n"]) == 3 << 30
    assert memory_cgroup.v2_limit(["max\n"]) is None
    assert (
        memory_cgroup.describe_oom_kill(1536 * MiB)
        == "was killed by the kernel's out-of-memory killer (the container's memory limit is 1536 MiB)"
    )
    assert "sets no limit" in memory_cgroup.describe_oom_kill(None)


def fake_v1_group(folder: Path, kills: int, limit: int = 1536 * MiB) -> memory_cgroup.MemoryCgroup:
    folder.mkdir(exist_ok=True)
    (folder / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")
    (folder / "memory.stat").write_text(f"cache 0\nhierarchical_memory_limit {limit}\n")
    return memory_cgroup.MemoryCgroup(str(folder), 1, str(folder.parent))


def test_a_v2_limit_is_the_least_of_the_group_and_its_ancestors(tmp_path):
    (tmp_path / "grader" / "ranks").mkdir(parents=True)
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "grader" / "memory.max").write_text(f"{3 << 30}\n")
    (tmp_path / "grader" / "ranks" / "memory.max").write_text("max\n")
    (tmp_path / "grader" / "ranks" / "memory.events").write_text("oom 0\noom_kill 0\n")
    group = memory_cgroup.MemoryCgroup(str(tmp_path / "grader" / "ranks"), 2, str(tmp_path))
    assert (group.limit(), group.oom_kills()) == (3 << 30, 0)


def dead_rank(group: memory_cgroup.MemoryCgroup, exitcode: int) -> RankHandle:
    """A RankHandle of a stand-in process that died with ``exitcode``, in the fake cgroup ``group``."""
    process = types.SimpleNamespace(pid=os.getpid(), exitcode=None, join=lambda timeout=None: None)
    rank = RankHandle(1, process, None)
    rank.memory = group
    rank.begin_task()  # notes the count
    process.exitcode = exitcode
    return rank


def test_a_sigkill_while_the_oom_kill_count_rose_is_reported_as_out_of_memory(tmp_path):
    group = fake_v1_group(tmp_path / "group", kills=2)
    rank = dead_rank(group, -9)
    assert rank.describe_exit() == "was killed by SIGKILL (exit code -9)"  # the count did not rise
    fake_v1_group(tmp_path / "group", kills=3)
    assert rank.describe_exit() == "was killed by the kernel's out-of-memory killer (the container's memory limit is 1536 MiB)"
    assert dead_rank(fake_v1_group(tmp_path / "other", kills=0), -11).describe_exit().startswith("was killed by SIGSEGV")


# ---------------------------------------------------------------------- the suite in a subprocess
def run_suite(
    impl: str, report: Path, *args: str, env: dict | None = None, cgroup: Path | None = None, profile: str = "brief"
) -> subprocess.CompletedProcess:
    """The all_reduce SUM test of the suite as a grader runs it, in a pytest subprocess that reports
    its own peak memory (tests/fixtures/peak_memory_plugin.py) to ``report``/peak.json; started in
    the v1 memory cgroup ``cgroup`` when given (the shell moves itself in, then becomes pytest)."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "conformance/test_collectives.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "peak_memory_plugin",
        "-k",
        "test_all_reduce and SUM",
        "--impl",
        impl,
        f"--hypothesis-profile={profile}",
        "--report-dir",
        str(report),
        *args,
    ]
    if cgroup is not None:
        command = ["sh", "-c", f'echo $$ > "{cgroup}/cgroup.procs" && exec "$@"', "sh", *command]
    environment = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(FIXTURES), str(ROOT)]), PEAK_MEMORY_FILE=str(report / "peak.json"), **(env or {})
    )
    report.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=environment)


def test_a_chatty_correct_all_reduce_passes_and_the_drivers_memory_stays_bounded(tmp_path):
    # 200 MiB per rank on each rank's first call. Measured on the 2-core machine: the driver's peak
    # RSS grew 14 MB from the session's start (835 MB before the output was bounded, which read and
    # decoded all of it); the bound is half of what one rank printed in one task.
    printed = 200 * MiB
    started = time.monotonic()
    result = run_suite(str(FIXTURES / "chatty_impl.py"), tmp_path, env={"CHATTY_BYTES": str(printed), "CHATTY_CALLS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["extra_data"]["complete"] and results["tests"], results
    assert results["score"] == results["max_score"] > 0
    assert all(test["status"] == "passed" for test in results["tests"])
    peak = json.loads((tmp_path / "peak.json").read_text())
    growth = (peak["at_end"] - peak["at_start"]) * 1024
    assert growth < printed / 2, (peak, time.monotonic() - started)


def writable_memory_cgroup() -> memory_cgroup.MemoryCgroup | None:
    """This process's v1 memory cgroup, where this process may make groups in it."""
    group = memory_cgroup.of_process(os.getpid())
    if group is None or group.version != 1 or os.geteuid() != 0 or not os.access(group.directory, os.W_OK):
        return None
    return group


def make_limited_group(parent: memory_cgroup.MemoryCgroup, limit: int) -> Path:
    group = Path(parent.directory) / f"conformance-oom-{secrets.token_hex(4)}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit))
    if (group / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swapping past the limit
        (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
    return group


def remove_group(group: Path) -> None:
    """Kill what is left in it (only processes this test started), then remove it."""
    for _ in range(50):
        pids = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    group.rmdir()


def run_in_limited_group(tmp_path: Path, env: dict | None = None):
    """The all_reduce SUM test on memory_hog_impl.py in a cgroup of 1.5 GiB: the quiet run of the same
    test peaked at 468 MB in its cgroup here (the driver, the forkserver and the ranks, whose pages
    shared with the forkserver are charged once); the last rank allocates 4 GiB."""
    limit = 1536 * MiB
    group = make_limited_group(writable_memory_cgroup(), limit)
    try:
        result = run_suite(str(FIXTURES / "memory_hog_impl.py"), tmp_path, cgroup=group, profile="ci", env=env)
        usage = int((group / "memory.max_usage_in_bytes").read_text())
        kills = memory_cgroup.oom_kills((group / "memory.oom_control").read_text())
    finally:
        remove_group(group)
    assert kills and kills >= 1 and usage <= limit
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["extra_data"]["complete"] and len(results["tests"]) == 1, results
    return result, results


NEEDS_CGROUP = pytest.mark.skipif(
    writable_memory_cgroup() is None, reason="needs root and a cgroup v1 memory controller that accepts new groups"
)


@NEEDS_CGROUP
def test_a_task_that_cannot_fit_even_alone_is_not_graded_naming_the_kernels_kill(tmp_path):
    result, results = run_in_limited_group(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]  # not a failure of the implementation
    test = results["tests"][0]
    assert test["score"] == test["max_score"] == 0 and results["max_score"] == 0, test  # neither for nor against
    assert results["extra_data"]["not_graded"] == [test["name"]], results["extra_data"]
    output = test["output"]
    assert "not graded: the container's memory" in output, output
    assert "was killed by the kernel's out-of-memory killer (the container's memory limit is 1536 MiB)" in output, output
    assert "run again with every other world closed" in output and "killed by SIGKILL" not in output, output
    assert "not graded" in results["output"], results["output"]  # the summary says so too


@NEEDS_CGROUP
def test_a_rank_killed_for_memory_once_is_rerun_alone_and_the_test_keeps_its_points(tmp_path):
    result, results = run_in_limited_group(tmp_path, env={"MEMORY_HOG_ONCE": str(tmp_path / "hogged")})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    test = results["tests"][0]
    assert test["status"] == "passed" and test["score"] == test["max_score"] > 0, test
    kills = results["extra_data"]["memory_kills"]
    assert len(kills) == 1 and "was killed by the kernel's out-of-memory killer" in kills[0], kills
    assert "memory: the kernel killed a rank for memory, not the implementation" in test["output"], test["output"]
