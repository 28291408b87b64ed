"""The harness's own tests: worlds survive broken implementations, failures name the rank and
cause, and the driver cannot be made to run code sent by a rank."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from parallelism_conformance.harness.driver.failures import ImplementationIncomplete, RankFailure, RanksCrashed, RanksHung, WorldStartError
from parallelism_conformance.harness.driver.pool import Attach, WorldPool

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parent.parent
CALL = "parallelism_conformance.harness.rank.programs.collectives:call"
ENVIRONMENT = "parallelism_conformance.harness.rank.programs.probe:rank_environment"


def all_reduce_task(n: int, group=None) -> list[dict]:
    return [{"function": "all_reduce", "arguments": {"tensor": torch.full((4,), float(r + 1)), "op": "SUM"}, "group": group} for r in range(n)]


@pytest.fixture
def pool():
    with WorldPool("gloo", timeout_s=3.0) as pool:
        yield pool


def fixture_impl(name: str) -> str:
    return str(FIXTURES / f"{name}.py")


def test_task_returns_every_ranks_output(pool):
    result = pool.run(3, CALL, all_reduce_task(3), impl="torch.distributed")
    assert [out["tensor"].tolist() for out in result.outputs] == [[6.0] * 4] * 3


@pytest.mark.parametrize("threads", [1, 2])
def test_ranks_run_with_the_thread_count_the_pool_asks_for(threads):
    # OMP_NUM_THREADS alone is ignored after the forkserver preloads torch; ranks once ran
    # cores-many threads each (8 threads for 4 ranks on 2 cores).
    with WorldPool("gloo", timeout_s=10.0, threads_per_rank=threads) as pool:
        result = pool.run(2, ENVIRONMENT, [{}] * 2, impl="torch.distributed")
    assert [out["threads"] for out in result.outputs] == [threads, threads]
    # whatever PYTHONDONTWRITEBYTECODE says: a .pyc a rank wrote during a task was counted by the audit
    assert not any(out["writes_bytecode"] for out in result.outputs)


def test_hang_is_reported_with_every_ranks_stack_and_the_next_task_runs(pool):
    with pytest.raises(RanksHung) as caught:  # rank 1 sleeps in a loop: not a deadlock, the deadline's case
        pool.run(2, CALL, all_reduce_task(2), impl=fixture_impl("hanging_impl"))
    message = str(caught.value)
    assert "no result within the 3 s deadline" in message  # the event: cut at the deadline, not waited out
    assert "rank 0 hung" in message and "rank 1 hung" in message
    assert "hanging_impl.py" in message  # rank 1's Python stack points into the implementation
    assert "distributed_c10d.py" in message  # rank 0's stack: waiting in the collective
    assert pool.rebuilds == 1
    assert pool.run(2, CALL, all_reduce_task(2), impl="torch.distributed").outputs[1]["tensor"][0] == 3.0


def test_segfault_names_the_rank_and_signal(pool):
    with pytest.raises(RanksCrashed) as caught:  # never re-run by Hypothesis: each try costs a world
        pool.run(2, CALL, all_reduce_task(2), impl=fixture_impl("crashing_impl"))
    message = str(caught.value)
    assert "rank 1 exited" in message and "SIGSEGV" in message
    assert "Segmentation fault" in message  # faulthandler's dump, from the rank's captured stderr
    assert "crashing_impl.py" in message
    assert pool.run(2, CALL, all_reduce_task(2), impl="torch.distributed").outputs[0]["tensor"][0] == 3.0


def test_exit_in_the_middle_of_a_task_is_reported(pool):
    with pytest.raises(RanksCrashed, match=r"rank 0 exited") as caught:
        pool.run(2, CALL, all_reduce_task(2), impl=fixture_impl("exiting_impl"))
    assert "exited with code 3" in str(caught.value)


def test_exception_in_one_rank_shows_its_traceback_and_everyones_output(pool):
    with pytest.raises(RanksCrashed) as caught:  # its peers hung: the world is rebuilt
        pool.run(3, CALL, all_reduce_task(3), impl=fixture_impl("raising_impl"))
    failure = caught.value.failure
    statuses = {report.rank: report.status for report in failure.ranks}
    assert statuses[2] == "raised" and statuses[0] == "hung" and statuses[1] == "hung"
    message = str(failure)
    assert "ValueError: deliberate failure in the last rank" in message
    assert "rank 2 says hello on stdout" in message and "rank 0 says hello on stderr" in message


def test_missing_function_is_a_clear_error_on_every_rank_and_keeps_the_world(pool):
    with pytest.raises(ImplementationIncomplete) as caught:
        pool.run(2, CALL, all_reduce_task(2), impl=fixture_impl("partial_impl"))
    assert caught.value.failure.same_error_everywhere() is not None
    assert "has no 'all_reduce'" in str(caught.value)
    assert pool.rebuilds == 0  # every rank answered: nothing to tear down


def test_an_implementation_that_destroys_the_process_group_fails_its_test_and_the_next_one_runs(pool):
    with pytest.raises(RanksCrashed, match="destroyed the default process group during this task") as caught:
        pool.run(2, CALL, all_reduce_task(2), impl=fixture_impl("world_destroying_impl"))
    assert {report.status for report in caught.value.failure.ranks} == {"broken"}
    assert pool.run(2, CALL, all_reduce_task(2), impl="torch.distributed").outputs[1]["tensor"][0] == 3.0
    assert pool.rebuilds == 1


def test_a_message_nobody_received_fails_the_task_that_sent_it_not_the_next_one(pool):
    # Without the check, the next test's receive from rank 0 takes these 20 bytes: a correct
    # implementation then dies with SIGABRT ("Received data size doesn't match expected size").
    with pytest.raises(RanksCrashed, match=r"found messages the implementation sent and nobody received.*rank 0 -> rank 1"):
        pool.run(2, CALL, all_reduce_task(2), impl=fixture_impl("stray_send_impl"))
    assert pool.rebuilds == 1
    assert pool.run(2, CALL, all_reduce_task(2), impl="parallelism_conformance.impls").outputs[1]["tensor"][0] == 3.0


def test_torch_settings_an_implementation_changes_do_not_leak_into_the_next_task(pool):
    before = pool.run(2, ENVIRONMENT, [{}] * 2, impl="torch.distributed").outputs
    result = pool.run(2, CALL, all_reduce_task(2), impl=fixture_impl("settings_leaking_impl"))
    assert result.outputs[0]["tensor"].tolist() == [3.0] * 4
    assert pool.run(2, ENVIRONMENT, [{}] * 2, impl="torch.distributed").outputs == before
    assert before[0]["default_dtype"] == "torch.float32" and before[0]["grad_enabled"] is True
    assert pool.rebuilds == 0


def test_unimportable_implementation_names_the_cause(pool):
    with pytest.raises(ImplementationIncomplete, match="could not load the implementation under test"):
        pool.run(1, CALL, all_reduce_task(1), impl=fixture_impl("unimportable_impl"))
    with pytest.raises(ImplementationIncomplete, match="could not load the implementation under test 'no_such_module'"):
        pool.run(1, CALL, all_reduce_task(1), impl="no_such_module")


def test_subgroup_whose_members_are_not_the_first_ranks(pool):
    outputs = pool.run(4, CALL, all_reduce_task(4, group=[1, 3]), impl="parallelism_conformance.impls").outputs
    assert outputs[0] is None and outputs[2] is None
    assert outputs[1]["tensor"].tolist() == outputs[3]["tensor"].tolist() == [6.0] * 4


def test_a_rank_cannot_make_the_driver_run_code(pool):
    marker = Path(__import__("tempfile").gettempdir()) / "conformance-grade-forged"
    marker.unlink(missing_ok=True)
    with pytest.raises(RankFailure, match="refuses to decode"):
        pool.run(2, CALL, all_reduce_task(2), impl=fixture_impl("grade_forging_impl"))
    assert not marker.exists()


def test_two_pools_rendezvous_independently():
    with WorldPool("gloo") as first, WorldPool("gloo") as second:
        a = first.run(2, CALL, all_reduce_task(2), impl="torch.distributed")
        b = second.run(2, CALL, all_reduce_task(2), impl="parallelism_conformance.impls")
        assert a.outputs[0]["tensor"].tolist() == b.outputs[0]["tensor"].tolist()


DRIVER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from parallelism_conformance.harness.driver.pool import WorldPool
    if __name__ == "__main__":
        pool = WorldPool("gloo")
        world = pool.world(3)
        print(" ".join(map(str, world.pids())), flush=True)
        time.sleep(600)
""")


def _alive(pid: int) -> bool:
    """True while `pid` runs and is not a zombie. The process may be reaped at any moment, even
    between opening and reading its /proc entry (ESRCH on the read): any of those means dead."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_killing_the_driver_with_sigkill_leaves_no_rank_behind(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT)))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "rank processes outlived a SIGKILLed driver"
    finally:
        driver.kill()


# ------------------------------------------------------------------ ranks started by a launcher
def free_port_pair() -> int:
    """A port p with p and p+1 free (the attach listener and the store)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports")


# How long the attach tests wait for torchrun's ranks: a launcher and two ranks each import torch
# (2.8 s of CPU alone); beside the mutation runner on 2 cores that once took over 60 s.
TORCHRUN_ATTACH_S = 300.0


def launch_torchrun(pool: WorldPool, nproc: int) -> subprocess.Popen:
    env = dict(
        os.environ, CONFORMANCE_DRIVER=f"{pool.attach.host}:{pool.attach.port}", CONFORMANCE_AUTHKEY=pool._authkey.hex(), PYTHONPATH=str(ROOT)
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "-m",
            "parallelism_conformance.harness.rank.loop",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def stop(launcher: subprocess.Popen) -> int | None:
    try:
        return launcher.wait(timeout=30)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()
        return None


def test_ranks_started_by_torchrun_attach_and_smaller_worlds_run_here():
    pool = WorldPool("gloo", timeout_s=10.0, attach=Attach(2, "127.0.0.1", free_port_pair(), bind="127.0.0.1", timeout_s=TORCHRUN_ATTACH_S))
    launcher = launch_torchrun(pool, 2)
    try:
        assert "CONFORMANCE_AUTHKEY=" in pool.attach_command() and "-m parallelism_conformance.harness.rank" in pool.attach_command()
        result = pool.run(2, CALL, all_reduce_task(2), impl="parallelism_conformance.impls")
        assert [out["tensor"].tolist() for out in result.outputs] == [[3.0] * 4] * 2
        assert pool.world(2).pids() == []  # nothing of it was started here
        with pytest.raises(ImplementationIncomplete) as caught:  # failures come back from attached ranks too
            pool.run(2, CALL, all_reduce_task(2), impl=fixture_impl("partial_impl"))
        assert "has no 'all_reduce'" in str(caught.value)
        local = pool.run(3, CALL, all_reduce_task(3), impl="parallelism_conformance.impls")
        assert [out["tensor"].tolist() for out in local.outputs] == [[6.0] * 4] * 3
        assert len(pool.world(3).pids()) == 3
    finally:
        pool.close()
        code = stop(launcher)
    assert code == 0, launcher.stdout.read().decode(errors="replace")[-2000:]  # ranks exit when the driver closes


def test_attached_ranks_of_the_wrong_world_size_are_refused_with_the_reason():
    pool = WorldPool("gloo", timeout_s=10.0, attach=Attach(3, "127.0.0.1", free_port_pair(), bind="127.0.0.1", timeout_s=TORCHRUN_ATTACH_S))
    launcher = launch_torchrun(pool, 2)
    try:
        with pytest.raises(WorldStartError, match="WORLD_SIZE=2, but this world has 3 ranks"):
            pool.run(3, CALL, all_reduce_task(3), impl="parallelism_conformance.impls")
    finally:
        pool.close()
        stop(launcher)


def test_attached_ranks_that_never_come_fail_once_then_at_once():
    pool = WorldPool("gloo", timeout_s=10.0, attach=Attach(2, "127.0.0.1", free_port_pair(), bind="127.0.0.1", timeout_s=1.0))
    try:
        with pytest.raises(WorldStartError, match=r"only 0/2 ranks connected in time \(missing ranks \[0, 1\]\)"):
            pool.run(2, CALL, all_reduce_task(2), impl="parallelism_conformance.impls")
        # at once: the pool says the world is gone without listening again (a second wait would end
        # in "only 0/2 ranks connected in time" instead)
        with pytest.raises(WorldStartError, match="the attached world of 2 ranks is gone"):
            pool.run(2, CALL, all_reduce_task(2), impl="parallelism_conformance.impls")
    finally:
        pool.close()
