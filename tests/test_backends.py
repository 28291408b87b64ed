"""Which backend each world size runs on (harness/driver/backends.py), with the GPU count faked: the GPU
runner's logic is tested on machines without a GPU."""

from __future__ import annotations

import pytest

from parallelism_conformance.harness.driver.backends import BackendChoiceError, BackendPlan
from parallelism_conformance.harness.driver.pool import WorldPool


@pytest.mark.parametrize(
    "requested, gpus, asked, by_size",
    [
        ("auto", 0, 4, ("gloo",) * 4),
        ("auto", 1, 4, ("nccl", "gloo", "gloo", "gloo")),
        ("auto", 2, 4, ("nccl", "nccl", "gloo", "gloo")),
        ("auto", 8, 4, ("nccl",) * 4),
        ("nccl", 2, 4, ("nccl", "nccl")),
        ("nccl", 1, 8, ("nccl",)),
        ("gloo", 8, 3, ("gloo",) * 3),
    ],
)
def test_each_world_size_gets_one_backend(requested, gpus, asked, by_size):
    plan = BackendPlan.resolve(requested, gpus, asked)
    assert plan.by_size == by_size
    assert [plan.backend(n) for n in range(1, plan.max_world_size + 1)] == list(by_size)


def test_a_one_gpu_runner_still_tests_every_world_size_and_says_where():
    plan = BackendPlan.resolve("auto", 1, 4)
    assert plan.max_world_size == 4 and plan.multi_rank()
    assert plan.coverage() == "world 1 on nccl (one GPU per rank, 1 visible); worlds 2-4 on gloo (CPU ranks)"


def test_nccl_only_names_the_worlds_it_cannot_draw_and_why():
    plan = BackendPlan.resolve("nccl", 2, 4)
    assert plan.not_drawn() == "worlds 3-4 not drawn: 2 GPUs visible, --backend nccl"
    assert plan.coverage() == ("worlds 1-2 on nccl (one GPU per rank, 2 visible); worlds 3-4 not drawn: 2 GPUs visible, --backend nccl")
    with pytest.raises(ValueError, match="a world of 3 ranks is not drawn"):
        plan.backend(3)


def test_a_run_with_no_world_of_two_says_nothing_distributed_is_tested():
    plan = BackendPlan.resolve("nccl", 1, 4)
    assert not plan.multi_rank()
    assert plan.coverage().endswith("no world of 2 or more ranks: nothing distributed is tested")


@pytest.mark.parametrize(
    "requested, gpus, asked, message",
    [
        ("nccl", 0, 4, "--backend nccl needs at least one visible GPU; none is visible"),
        ("mpi", 0, 4, "--backend must be auto, gloo or nccl"),
        ("auto", 0, 0, "--max-world-size must be at least 1"),
    ],
)
def test_what_the_machine_cannot_give_is_refused(requested, gpus, asked, message):
    with pytest.raises(BackendChoiceError, match=message):
        BackendPlan.resolve(requested, gpus, asked)


def test_a_pool_given_a_plan_starts_each_world_on_the_plans_backend():
    plan = BackendPlan.resolve("auto", 1, 3)
    pool = WorldPool(plan)
    try:
        assert [pool.backend_for(n) for n in (1, 2, 3)] == ["nccl", "gloo", "gloo"]
    finally:
        pool.close()


def test_the_oracle_computes_where_each_world_computes():
    """Measured on an H200: a world-1 DP gradient on CUDA sat 2.4e-8 from the CPU oracle's (bound
    7.9e-9), cuBLAS summing in another order; the oracle runs a slice's backward on the ranks' kind of
    device, so each world size names its device."""
    plan = BackendPlan.resolve("auto", 2, 4)
    assert [plan.device_type(n) for n in range(1, 5)] == ["cuda", "cuda", "cpu", "cpu"]
    assert [BackendPlan.resolve("gloo", 2, 2).device_type(n) for n in (1, 2)] == ["cpu", "cpu"]


def test_a_torch_older_than_any_the_suite_ran_on_is_named_in_the_header():
    from parallelism_conformance.harness.driver.reports import older_torch_warning

    assert older_torch_warning("2.13.0+cpu") is None and older_torch_warning("2.11.0+cu130") is None
    assert older_torch_warning("3.0.0") is None
    assert "torch 2.4.1+cu121 is older than the oldest torch this suite is tested on (2.11)" in older_torch_warning("2.4.1+cu121")
    assert older_torch_warning("2.10.0a0+git123") is not None


def test_the_scorecard_repeats_the_older_torch_warning_under_its_coverage_line():
    from parallelism_conformance.harness.driver.scorecard import Scorecard, TestResult

    class Config:
        def getoption(self, name):
            return "student.py"

    class Terminal:
        lines: list[str] = []

        def section(self, title):
            self.lines.append(f"== {title}")

        def write_line(self, line):
            self.lines.append(line)

    for warning in ("torch 2.4.1 is older than ...", None):
        card = Scorecard(Config(), coverage=lambda: "worlds 1-4 on gloo", warning=warning)
        card.results["t::x"] = TestResult("t::x", "all_reduce", "passed", "", 0.1)
        terminal = Terminal()
        terminal.lines = []
        card.pytest_terminal_summary(terminal)
        coverage_at = terminal.lines.index("coverage: worlds 1-4 on gloo")
        assert (terminal.lines[coverage_at + 1] == f"WARNING: {warning}") == (warning is not None)
        assert sum(line.startswith("WARNING") for line in terminal.lines) == (warning is not None)
