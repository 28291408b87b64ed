"""The suite's command-line options: declared, checked once before any test runs (every bad option
is one clear usage error), and what they select (the claimed capabilities, the attached world)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.errors import InvalidArgument

from parallelism_conformance.harness.driver import capabilities
from parallelism_conformance.harness.driver.backends import BackendChoiceError, BackendPlan, visible_gpus
from parallelism_conformance.harness.driver.libraries.table import LIBRARIES
from parallelism_conformance.harness.driver.plugin.profiles import PROFILES, current_profile
from parallelism_conformance.harness.driver.pool import Attach
from parallelism_conformance.harness.driver.rubric import DEFAULT_RUBRIC

DEFAULT_IMPL = "parallelism_conformance.impls"
GRADING_BUDGET_S = 480.0  # the grading profile's default --time-budget: within a platform's default 10 minutes, with
# time left to start, collect and report (run_autograder sets it from the limit the course chose)


# --scope: what the implementation is held to, and what the coverage line adds for it
SCOPES = {
    "contract": "",
    "cs336": "; scope: the CS336 handout (one backward per step, set_to_none=True, every parameter used, "
    "float32 models, weights broadcast, not buffers; ZeRO-1 balanced in parameters or elements; FSDP on "
    "untied models whose weights' rows divide by the world size): tests beyond it skipped",
}


def pytest_addoption(parser):
    group = parser.getgroup("conformance")
    group.addoption(
        "--impl",
        default=DEFAULT_IMPL,
        help="implementation under test: a module name or a path to a .py file "
        f"(default: {DEFAULT_IMPL}, the bundled one; torch.distributed is valid too)",
    )
    group.addoption(
        "--backend",
        default="auto",
        choices=("auto", "gloo", "nccl"),
        help="process-group backend of the ranks (auto: worlds of up to as many ranks as visible GPUs "
        "on nccl, one GPU per rank, larger worlds on gloo with CPU tensors; nccl: nccl only, "
        "worlds capped at the GPU count; gloo: CPU ranks only)",
    )
    group.addoption(
        "--max-world-size", type=int, default=None, help="largest world Hypothesis draws (default 4, 8 under --hypothesis-profile=thorough)"
    )
    group.addoption("--rank-timeout", type=float, default=60.0, help="seconds a task may take on the ranks before it is reported as a hang")
    group.addoption(
        "--audit-require-p2p",
        default="auto",
        choices=("auto", "yes", "no"),
        help="communication audit: require collectives built from send/recv only (auto: every "
        "implementation but torch.distributed and adapters.*, which are skipped with what they sent)",
    )
    group.addoption(
        "--require-bounds",
        default="auto",
        choices=("auto", "yes", "no"),
        help="communication audit: bytes above the theory's bound fail the test (yes), or are reported "
        "as 'costs more' with their ratio beside a pass (no); auto: yes under the grading profile and "
        "for every implementation but a training library's adapter",
    )
    group.addoption(
        "--attach",
        type=int,
        default=None,
        metavar="N",
        help="run every world of N ranks on ranks started by a launcher (torchrun), on this host "
        "or others, instead of starting them here; smaller worlds still run here. The driver "
        "prints the command to start them.",
    )
    group.addoption(
        "--attach-address",
        default="127.0.0.1:29650",
        metavar="HOST:PORT",
        help="with --attach: the address attached ranks dial (the driver listens on PORT on every interface and serves its store on PORT+1)",
    )
    group.addoption("--attach-timeout", type=float, default=300.0, help="with --attach: seconds to wait for the attached ranks to connect")
    group.addoption(
        "--parallelize",
        default=None,
        metavar="MODULE:FUNCTION",
        help="grade a function parallelize(model, mesh) -> model (or PATH.py:FUNCTION) on the suite's decoder LM, step by step "
        "against one process (capability parallelize; CONTRACT.md, 'A parallelize function'); without it that test is skipped",
    )
    group.addoption(
        "--parallelize-matrix",
        default=None,
        metavar="PATH.md",
        help="with --parallelize: write the parity matrix (every mesh factorisation against its verdict, also printed at "
        "the end) as markdown to PATH.md and as a heat map to PATH.png (where matplotlib is installed)",
    )
    group.addoption("--report-dir", default=None, help="write grading files here: Gradescope results.json, junit.xml, summary.txt")
    group.addoption("--rubric", default=str(DEFAULT_RUBRIC), help="TOML file of points per capability (default: grading/rubric.toml)")
    group.addoption(
        "--points-possible",
        type=float,
        default=None,
        metavar="N",
        help="scale the points of whatever ran so that the maximum is exactly N (overrides the "
        "rubric's points_possible; default: the rubric's points, unscaled)",
    )
    group.addoption(
        "--capability",
        default=None,
        metavar="NAME[,NAME]",
        help="the capabilities the implementation claims (names or groups of harness/driver/capabilities.py, "
        "e.g. collectives,data_parallel); the others are not run (default: every one)",
    )
    group.addoption(
        "--time-budget",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds the whole run may take on ranks; each test draws examples for its share of what is "
        f"left (at least 10 examples), and past the budget no task starts and the tests left are reported "
        f"as not run (default: none; {GRADING_BUDGET_S:g} under the grading profile)",
    )
    group.addoption(
        "--scope",
        default="contract",
        choices=tuple(SCOPES),
        help="what the implementation is held to: contract (CONTRACT.md, the default) or cs336 (the "
        "CS336 assignment 2 handout's data-parallel loop: one backward per step, "
        "zero_grad(set_to_none=True), every parameter used in every step, the weights broadcast "
        "but not the buffers; its sharded optimizer balanced in parameters or elements; its FSDP "
        "trained on untied float32 models whose weights' rows divide by the world size; the "
        "tests of what lies beyond it are skipped, and the coverage line says so)",
    )
    group.addoption(
        "--max-live-ranks",
        default="auto",
        help="how many rank processes may stay alive at once across the session's worlds (least "
        "recently used worlds are closed first; auto: what the container's memory limit holds, "
        "no cap without one)",
    )
    group.addoption(
        "--rank-memory",
        default="auto",
        help="MiB one live rank is taken to cost before this run has measured one (auto: a light "
        "rank's 128 MiB); the live-rank cap then follows the largest rank the kernel reports",
    )
    group.addoption(
        "--perturb-timing",
        default="auto",
        choices=("auto", "on", "every", "off"),
        help="every call the implementation makes through a process group can complete late, by a "
        "delay Hypothesis draws per call and shrinks: outputs hold poison (NaN) until waited for, "
        "a send reads its buffer when it leaves (auto: on under the ci and grading profiles; every: "
        "no call completes as the backend completes it, so a result read before its wait always holds "
        "poison: the mutation runner's race mutants)",
    )
    group.addoption(
        "--contain-ranks",
        default="auto",
        choices=("auto", "yes", "no"),
        help="run each world's ranks as a user of its own in a private directory, all their processes "
        "killed with the world (needs root; auto: yes under the grading profile when root)",
    )


def check_options(config) -> None:
    """Every bad option is one clear usage error before any test runs, never an error per test."""
    if config.getoption("--max-world-size") is not None and config.getoption("--max-world-size") < 1:
        raise pytest.UsageError("--max-world-size must be at least 1")
    for option in ("--rank-timeout", "--attach-timeout", "--time-budget"):
        if config.getoption(option) is not None and not config.getoption(option) > 0:
            raise pytest.UsageError(f"{option} must be a positive number of seconds, got {config.getoption(option):g}")
    possible = config.getoption("--points-possible")
    if possible is not None and not 0 < possible < float("inf"):
        raise pytest.UsageError(f"--points-possible must be a positive number of points, got {possible:g}")
    try:
        capabilities.select(config.getoption("--capability"))
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    profile = getattr(config.option, "hypothesis_profile", None)
    if profile is not None:
        try:
            settings.get_profile(profile)
        except InvalidArgument:
            raise pytest.UsageError(f"--hypothesis-profile={profile}: no such profile; this suite registers {', '.join(PROFILES)}") from None
    try:  # --backend nccl without a GPU fails here, once
        BackendPlan.resolve(config.getoption("--backend"), visible_gpus(), 1)
    except BackendChoiceError as error:
        raise pytest.UsageError(str(error)) from None
    if config.getoption("--attach") is not None:
        _check_attach_options(config)
    live = config.getoption("--max-live-ranks")
    if live != "auto" and (not live.isdigit() or int(live) < 1):
        raise pytest.UsageError(f"--max-live-ranks must be auto or a positive number of ranks, got {live!r}")
    first = config.getoption("--rank-memory")
    if first != "auto" and (not first.isdigit() or int(first) < 1):
        raise pytest.UsageError(f"--rank-memory must be auto or a positive number of MiB, got {first!r}")


def _check_attach_options(config) -> None:
    if config.getoption("--attach") < 1:
        raise pytest.UsageError("--attach must be at least 1")
    if getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        raise pytest.UsageError("--attach cannot be combined with -n: one driver serves the attached ranks")
    host, _, port = config.getoption("--attach-address").rpartition(":")
    if not host or not port.isdigit():
        raise pytest.UsageError(f"--attach-address must be HOST:PORT, got {config.getoption('--attach-address')!r}")


def attached_world(config) -> Attach | None:
    if config.getoption("--attach") is None:
        return None
    host, _, port = config.getoption("--attach-address").rpartition(":")
    return Attach(config.getoption("--attach"), host, int(port), timeout_s=config.getoption("--attach-timeout"))


PERTURBED_PROFILES = ("ci", "grading")  # where --perturb-timing auto is on


def perturb_timing(config) -> str:
    """--perturb-timing, resolved: "on", "every" or "off" (auto: on under PERTURBED_PROFILES)."""
    option = config.getoption("--perturb-timing")
    if option == "auto":
        return "on" if current_profile() in PERTURBED_PROFILES else "off"
    return option


def claimed(config) -> frozenset[str]:
    """The capabilities the implementation claims (--capability; every one by default, but only
    ``parallelize`` where --parallelize names a team's function: its run grades that function, not
    the bundled implementations)."""
    spec = config.getoption("--capability")
    if spec is None and config.getoption("--parallelize") is not None:
        return frozenset({"parallelize"})
    return capabilities.select(spec)


def library_of(impl: str):
    """The training library whose adapter ``impl`` is (harness/driver/libraries/table.py), or None."""
    return next((library for library in LIBRARIES.values() if any(run.adapter == impl for run in library.runs)), None)


def declared_designs(config) -> dict:
    """The documented behaviours of the library under test that its table entry declares (name ->
    (behaviour, source)): none for any other implementation, and none under the grading profile,
    where only the contract's semantics grade."""
    library = library_of(config.getoption("--impl"))
    return {} if library is None or current_profile() == "grading" else dict(library.by_design)


def bounds_required(config) -> bool:
    """--require-bounds resolved: a library teams train with is held to its values and its rules, and
    its costs above the theory are reported as such, unless asked; a student's or a team's own
    implementation (the contract's scope) and every grading run are held to the bound."""
    option = config.getoption("--require-bounds")
    if option != "auto":
        return option == "yes"
    if current_profile() == "grading":
        return True
    return library_of(config.getoption("--impl")) is None
