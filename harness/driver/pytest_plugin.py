"""The pytest side of the harness: options, Hypothesis profiles, the session's world pool, the
backend probe, and the scorecard. Loaded by the top-level conftest.py."""
from __future__ import annotations

import functools
import os
import re
import shlex
import sys
import time
from pathlib import Path
from collections import Counter
from dataclasses import dataclass, field
from typing import NoReturn

import pytest
from hypothesis import HealthCheck, Phase, currently_in_test_context, reject, settings
from hypothesis.errors import HypothesisException, InvalidArgument

from harness.driver import capabilities
from harness.rank import containment
from harness.driver.backends import BackendChoiceError, BackendPlan, visible_gpus
from harness.driver.failures import RanksHung
from harness.driver.gradescope import limits
from harness.driver.pool import Attach, LiveRanks, WorldPool
from harness.driver.reports import DEFAULT_RUBRIC, Rubric, hypothesis_settings, load_rubric, older_torch_warning
from harness.driver.reports import versions as run_versions
from harness.driver.reports import write as write_reports
from harness.driver.scorecard import Scorecard

DEFAULT_IMPL = "impls"
GRADING_BUDGET_S = 480.0  # the grading profile's default --time-budget: within a platform's default 10 minutes, with
# time left to start, collect and report (run_autograder sets it from the limit the course chose)

# filter_too_much: an example the project's own adapters say torch cannot run is rejected
# (conformance.verdict.run_or_skip); for torch's runtime that is most random pipeline orders
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
PROFILES = {
    "quick": dict(max_examples=15),
    "ci": dict(max_examples=25, derandomize=True, print_blob=True),
    "thorough": dict(max_examples=150, print_blob=True),
    "grading": dict(max_examples=50, derandomize=True, print_blob=True),
    # For harness.driver.mutation: like ci, but a mutant is killed by its first failure; no time spent shrinking.
    "mutation": dict(max_examples=25, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate]),
    # For harness.driver.mutation's correct implementations under outsiders/: a whole conformance file each.
    "brief": dict(max_examples=10, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate]),
}
for _name, _options in PROFILES.items():
    settings.register_profile(_name, **_options, **_COMMON)
settings.load_profile(os.environ.get("CONFORMANCE_HYPOTHESIS_PROFILE", "quick"))


# --scope: what the implementation is held to, and what the coverage line adds for it
SCOPES = {"contract": "",
          "cs336": "; scope: the CS336 handout (one backward per step, set_to_none=True, every parameter used, "
                   "weights broadcast, not buffers; ZeRO-1 balanced in parameters, not elements): tests beyond it "
                   "skipped"}


def pytest_addoption(parser):
    group = parser.getgroup("conformance")
    group.addoption("--impl", default=DEFAULT_IMPL,
                    help="implementation under test: a module name or a path to a .py file "
                         f"(default: {DEFAULT_IMPL}, the bundled one; torch.distributed is valid too)")
    group.addoption("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                    help="process-group backend of the ranks (auto: worlds of up to as many ranks as visible GPUs "
                         "on nccl, one GPU per rank, larger worlds on gloo with CPU tensors; nccl: nccl only, "
                         "worlds capped at the GPU count; gloo: CPU ranks only)")
    group.addoption("--max-world-size", type=int, default=None,
                    help="largest world Hypothesis draws (default 4, 8 under --hypothesis-profile=thorough)")
    group.addoption("--rank-timeout", type=float, default=60.0,
                    help="seconds a task may take on the ranks before it is reported as a hang")
    group.addoption("--audit-require-p2p", default="auto", choices=("auto", "yes", "no"),
                    help="communication audit: require collectives built from send/recv only (auto: every "
                         "implementation but torch.distributed and adapters.*, which are skipped with what they sent)")
    group.addoption("--attach", type=int, default=None, metavar="N",
                    help="run every world of N ranks on ranks started by a launcher (torchrun), on this host "
                         "or others, instead of starting them here; smaller worlds still run here. The driver "
                         "prints the command to start them.")
    group.addoption("--attach-address", default="127.0.0.1:29650", metavar="HOST:PORT",
                    help="with --attach: the address attached ranks dial (the driver listens on PORT on every "
                         "interface and serves its store on PORT+1)")
    group.addoption("--attach-timeout", type=float, default=300.0,
                    help="with --attach: seconds to wait for the attached ranks to connect")
    group.addoption("--report-dir", default=None,
                    help="write grading files here: Gradescope results.json, junit.xml, summary.txt")
    group.addoption("--rubric", default=str(DEFAULT_RUBRIC),
                    help="TOML file of points per capability (default: grading/rubric.toml)")
    group.addoption("--points-possible", type=float, default=None, metavar="N",
                    help="scale the points of whatever ran so that the maximum is exactly N (overrides the "
                         "rubric's points_possible; default: the rubric's points, unscaled)")
    group.addoption("--capability", default=None, metavar="NAME[,NAME]",
                    help="the capabilities the implementation claims (names or groups of harness/driver/capabilities.py, "
                         "e.g. collectives,data_parallel); the others are not run (default: every one)")
    group.addoption("--time-budget", type=float, default=None, metavar="S",
                    help=f"seconds the whole run may take on ranks; past it no task starts and the tests left are "
                         f"reported as not run (default: none; {GRADING_BUDGET_S:g} under the grading profile)")
    group.addoption("--scope", default="contract", choices=tuple(SCOPES),
                    help="what the implementation is held to: contract (CONTRACT.md, the default) or cs336 (the "
                         "CS336 assignment 2 handout's data-parallel loop: one backward per step, "
                         "zero_grad(set_to_none=True), every parameter used in every step, the weights broadcast "
                         "but not the buffers; its sharded optimizer balanced in parameters, not elements; the "
                         "tests of what lies beyond it are skipped, and the coverage line says so)")
    group.addoption("--max-live-ranks", default="auto",
                    help="how many rank processes may stay alive at once across the session's worlds (least "
                         "recently used worlds are closed first; auto: what the container's memory limit holds, "
                         "no cap without one)")
    group.addoption("--contain-ranks", default="auto", choices=("auto", "yes", "no"),
                    help="run each world's ranks as a user of its own in a private directory, all their processes "
                         "killed with the world (needs root; auto: yes under the grading profile when root)")


def pytest_report_header(config):
    import torch

    warning = older_torch_warning(torch.__version__)
    return [f"WARNING: {warning}"] if warning else []


@pytest.hookimpl(tryfirst=True)  # before the junitxml plugin reads its path
def pytest_configure(config):
    config.addinivalue_line("markers", "capability(name): the capability a test grades (scorecard row)")
    _check_options(config)
    report_dir = config.getoption("--report-dir")
    import torch

    config.stash[_CONTAINED] = _decide_containment(config)
    scorecard = Scorecard(config, coverage=lambda: (backend_plan(config).coverage() + SCOPES[config.getoption("--scope")]
                                                    + containment_note(config)),
                          warning=older_torch_warning(torch.__version__))
    config.pluginmanager.register(scorecard, "conformance-scorecard")
    if report_dir:
        try:  # read once, now: nothing a rank does later can change the points
            rubric = load_rubric(Path(config.getoption("--rubric")))
        except (OSError, ValueError) as error:
            raise pytest.UsageError(f"--rubric: {error}") from error
        if not getattr(config.option, "xmlpath", None):
            config.option.xmlpath = str(Path(report_dir) / "junit.xml")
        if not hasattr(config, "workerinput"):  # the xdist controller (or the only process) writes them
            config.pluginmanager.register(GradingFiles(config, scorecard, rubric), "conformance-grading-files")


def _check_options(config) -> None:
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
            raise pytest.UsageError(f"--hypothesis-profile={profile}: no such profile; this suite registers "
                                    f"{', '.join(PROFILES)}") from None
    try:  # --backend nccl without a GPU fails here, once
        BackendPlan.resolve(config.getoption("--backend"), visible_gpus(), 1)
    except BackendChoiceError as error:
        raise pytest.UsageError(str(error)) from None
    if config.getoption("--attach") is not None:
        _check_attach_options(config)
    live = config.getoption("--max-live-ranks")
    if live != "auto" and (not live.isdigit() or int(live) < 1):
        raise pytest.UsageError(f"--max-live-ranks must be auto or a positive number of ranks, got {live!r}")


def _check_attach_options(config) -> None:
    if config.getoption("--attach") < 1:
        raise pytest.UsageError("--attach must be at least 1")
    if getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        raise pytest.UsageError("--attach cannot be combined with -n: one driver serves the attached ranks")
    host, _, port = config.getoption("--attach-address").rpartition(":")
    if not host or not port.isdigit():
        raise pytest.UsageError(f"--attach-address must be HOST:PORT, got {config.getoption('--attach-address')!r}")


def _attach(config) -> Attach | None:
    if config.getoption("--attach") is None:
        return None
    host, _, port = config.getoption("--attach-address").rpartition(":")
    return Attach(config.getoption("--attach"), host, int(port), timeout_s=config.getoption("--attach-timeout"))


def claimed(config) -> frozenset[str]:
    """The capabilities the implementation claims (--capability; every one by default)."""
    return capabilities.select(config.getoption("--capability"))


def pytest_collection_modifyitems(config, items):
    """Tests of capabilities the implementation does not claim (--capability) are not run. Each kept
    test is tagged with its capability here, before any fixture runs, so that a test whose session
    fixture fails at setup (a probe that crashed, a budget spent) is still reported for its capability."""
    chosen = claimed(config)
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("capability")
        dropped = marker is not None and marker.args[0] not in chosen
        if marker is not None and not dropped:
            item.user_properties.append(("capability", marker.args[0]))
        (drop if dropped else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session):
    """Without xdist, the grading files know every selected test before the first runs."""
    scorecard = session.config.pluginmanager.get_plugin("conformance-scorecard")
    if scorecard is not None and not hasattr(session.config, "workerinput"):
        scorecard.expect(session.items)


def pytest_sessionstart(session):
    """The run's state (after Hypothesis has loaded --hypothesis-profile, which sets the budget's
    default), and the coverage line as a JUnit property of the run."""
    session.config.stash[_STATE] = RunState(Budget(session.config), LiveRanks(max_live_ranks(session.config)))
    key = _junit_key()
    xml = session.config.stash.get(key, None) if key is not None else None
    if xml is not None:
        xml.add_global_property("coverage", backend_plan(session.config).coverage())
        xml.add_global_property("implementation", session.config.getoption("--impl"))


def _junit_key():
    try:
        from _pytest.junitxml import xml_key
    except ImportError:  # pytest moved it: the property is a nicety, the run goes on
        return None
    return xml_key


class GradingFiles:
    """Writes results.json and summary.txt when the session starts, after every test and at the end
    (harness/driver/reports.py), so that a run stopped from outside still leaves its last state."""

    def __init__(self, config, scorecard: Scorecard, rubric: Rubric):
        self.config, self.scorecard, self.rubric = config, scorecard, rubric
        self.started = time.monotonic()
        # read now, like the rubric, before any rank starts: a rank cannot change what is recorded
        self.run = {"versions": run_versions()}

    def write(self, complete: bool) -> None:
        write_reports(self.scorecard, Path(self.config.getoption("--report-dir")), self.rubric,
                      Path(self.config.getoption("--rubric")), self.config.getoption("--impl"),
                      seconds=time.monotonic() - self.started, complete=complete,
                      points_possible=self.config.getoption("--points-possible"), run=self.run)

    def pytest_sessionstart(self, session):
        # after Hypothesis's own pytest_configure has loaded --hypothesis-profile and --hypothesis-seed
        self.run["hypothesis"] = hypothesis_settings(_profile(), session.config.getoption("--hypothesis-seed", None))
        self.write(complete=False)

    @pytest.hookimpl(trylast=True)  # after the scorecard has taken the report
    def pytest_runtest_logreport(self, report):
        if report.when == "teardown":
            self.write(complete=False)

    def pytest_unconfigure(self, config):
        self.write(complete=True)


@dataclass(frozen=True)
class Target:
    """What is under test and where it runs, as the driver knows it (never the module itself)."""

    impl: str
    backend: str  # the --backend option; plan.backend(n) is what a world of n ranks runs on
    max_world_size: int
    profile: str
    attach: str = ""  # the --attach options of this run, if any
    plan: BackendPlan | None = None
    scope: str = "contract"  # --scope: the contract, or a handout's narrower loop (SCOPES)

    def reproduce(self, nodeid: str) -> str:
        return (f"pytest {shlex.quote(nodeid)} --impl {shlex.quote(self.impl)} --backend {self.backend} "
                f"--hypothesis-profile={self.profile} --max-world-size {self.max_world_size}{self.attach}"
                + (f" --scope {self.scope}" if self.scope != "contract" else ""))


def _profile() -> str:
    return settings._current_profile or "quick"


def backend_plan(config) -> BackendPlan:
    """Which backend each world size runs on in this session (harness/driver/backends.py), decided once."""
    plan = config.stash.get(_PLAN, None)
    if plan is None:
        asked = config.getoption("--max-world-size") or (8 if _profile() == "thorough" else 4)
        attach = _attach(config)
        if attach is not None:
            asked = attach.size  # the attached world is the largest drawn; smaller ones run here
        plan = config.stash[_PLAN] = BackendPlan.resolve(config.getoption("--backend"), visible_gpus(), asked)
    return plan


_PLAN = pytest.StashKey[BackendPlan]()


@pytest.fixture(scope="session")
def target(pytestconfig) -> Target:
    plan = backend_plan(pytestconfig)
    profile = _profile()
    attach, attach_options = _attach(pytestconfig), ""
    if attach is not None:
        attach_options = f" --attach {attach.size} --attach-address {attach.host}:{attach.port}"
    return Target(pytestconfig.getoption("--impl"), pytestconfig.getoption("--backend"), plan.max_world_size, profile,
                  attach_options, plan, pytestconfig.getoption("--scope"))


class Budget:
    """The run's --time-budget (the grading profile's default when not given), counted from the
    session's start in this process."""

    def __init__(self, config):
        self.seconds = config.getoption("--time-budget") or (GRADING_BUDGET_S if _profile() == "grading" else None)
        self.deadline = None if self.seconds is None else time.monotonic() + self.seconds

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def spent(self) -> bool:
        return self.left() <= 0


def max_live_ranks(config) -> int | None:
    """--max-live-ranks: a number, or auto (what the container's memory limit holds; no cap without one)."""
    option = config.getoption("--max-live-ranks")
    if option == "auto":
        return limits.live_ranks_for(limits.read().memory_bytes)
    return int(option)


_CONTAINED = pytest.StashKey[bool]()


def _contain(config) -> bool:
    """Whether ranks run contained, decided once by :func:`_decide_containment`."""
    return config.stash.get(_CONTAINED, False)


def _decide_containment(config) -> bool:
    """Contain ranks under --contain-ranks yes, and under the grading profile unless told
    --contain-ranks no. Fails closed: where ranks cannot be contained (not root, or a probe rank
    that cannot drop every privilege or cannot then read what it must run), grading stops with the
    reason instead of running the submission with the driver's rights."""
    option = config.getoption("--contain-ranks")
    profile = getattr(config.option, "hypothesis_profile", None) or _profile()
    if option == "no" or (option == "auto" and profile != "grading"):
        return False
    asked = "--contain-ranks yes" if option == "yes" else "the grading profile"
    if not containment.possible():
        raise pytest.UsageError(f"{asked} runs each world's ranks as a user of its own, which needs root, and this "
                                "run is not root; pass --contain-ranks no to run the implementation with this "
                                "user's rights (the report then says the ranks were not contained)")
    reason = containment.probe(_paths_a_rank_reads(config))
    if reason:
        raise pytest.UsageError(f"{asked}: ranks cannot be contained here: {reason}. Pass --contain-ranks no to run "
                                "them uncontained (the report then says so)")
    return True


def _paths_a_rank_reads(config) -> list[str]:
    """What a contained rank must still read: its Python's standard library and torch, the suite's
    rank code, and the implementation file under test (a module name is found on sys.path later)."""
    import torch

    paths = [os.__file__, torch.__file__, str(Path(containment.__file__))]
    impl = config.getoption("--impl")
    if impl.endswith(".py") or os.sep in impl:
        paths.append(os.path.abspath(impl))
    if impl == "adapters.cs336" and os.environ.get("CS336_SUBMISSION"):
        paths.append(os.path.abspath(os.environ["CS336_SUBMISSION"]))  # the submission the adapter loads
    return paths


def containment_note(config) -> str:
    """The coverage line's word on containment: graders and students see whether it held."""
    if _contain(config):
        return "; ranks contained (a uid of their own per world, no privilege left)"
    if getattr(config.option, "hypothesis_profile", None) == "grading":
        return "; ranks NOT contained (--contain-ranks no): the implementation ran with the grader's rights"
    return ""


@dataclass
class RunState:
    """What the driver keeps about this run between tests (in config.stash, made in pytest_configure)."""

    budget: Budget
    live_ranks: LiveRanks = field(default_factory=LiveRanks)  # the cap shared by the session's pools
    world_sizes: set = field(default_factory=set)  # of the current test's tasks (emptied before each test)
    hung: dict = field(default_factory=dict)  # capability -> the test in which its ranks hung
    refusals: Refusals = field(default_factory=lambda: Refusals())  # of the current test (emptied before each)


class EnoughRefused(pytest.skip.Exception):
    """Raised by Refusals.refuse when a test that ran examples has had REFUSAL_BUDGET refused: it
    stops drawing (each refusal is a task on the ranks), and pytest_runtest_makereport reports it
    as passed with a note."""


@dataclass
class Refusals:
    """What the project's own adapters said torch's library cannot run, in the current test
    (conformance.verdict.run_or_skip): such an example is rejected and Hypothesis draws another.
    A test none of whose first REFUSALS_BEFORE_SKIP examples ran is skipped with the reasons; one
    that ran some stops drawing at REFUSAL_BUDGET refusals, and passes with a note of what it ran
    and what it did not."""

    REFUSALS_BEFORE_SKIP = 10
    # torch's runtime refuses 150-204 random pipeline orders for every 25 it runs (measured); 50
    # refusals let 9-17 run, at a quarter of the tasks of drawing until 25 ran
    REFUSAL_BUDGET = 50

    reasons: Counter = field(default_factory=Counter)  # reason without its particulars -> count
    first: dict = field(default_factory=dict)  # reason without its particulars -> the first one said
    # the examples (by their Judge, one per example; held, so that no id is reused) that ran a task,
    # and those refused: an example that generated its schedule and was refused its step did not run
    _ran: dict = field(default_factory=dict)
    _refused: dict = field(default_factory=dict)
    # an example of this test failed (watch_failures): from then on refusals only reject, so that
    # neither a skip nor a stop can end the test while Hypothesis shrinks the failure
    failed: bool = False

    def refuse(self, reason: str, example) -> NoReturn:
        """Inside a Hypothesis test: reject the example (or skip, or stop, as the class says);
        outside one: skip the test with the reason."""
        general = re.sub(r" \([^()]*\)", "", reason)  # "(batch 3, m=2)", "(3 4 0 1 2 5)"
        self.reasons[general] += 1
        self.first.setdefault(general, reason)
        self._refused[id(example)] = example
        if not currently_in_test_context():
            pytest.skip(reason)
        if self.failed:
            reject()
        if not self.ran() and self.total() >= self.REFUSALS_BEFORE_SKIP:
            pytest.skip(f"no drawn example ran: {self.summary()}")
        if self.total() >= self.REFUSAL_BUDGET:
            raise EnoughRefused(self.note())
        reject()

    def ran_task(self, example) -> None:
        self._ran[id(example)] = example

    def ran(self) -> int:
        """Examples that ran and were not refused."""
        return len(self._ran.keys() - self._refused.keys())

    def total(self) -> int:
        return sum(self.reasons.values())

    def clear(self) -> None:
        self.reasons.clear()
        self.first.clear()
        self._ran.clear()
        self._refused.clear()
        self.failed = False

    def watch_failures(self, test) -> None:
        """Wrap a Hypothesis test's inner function (``test.hypothesis.inner_test``, Hypothesis's
        documented hook) so that an example that fails (an Exception other than Hypothesis's own,
        such as a rejection) sets ``failed``. Once per test function."""
        handle = getattr(test, "hypothesis", None)
        if handle is None or getattr(handle.inner_test, "_watched_by", None) is self:
            return
        inner = handle.inner_test

        @functools.wraps(inner)
        def watched(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            except HypothesisException:  # a rejection; StopTest and pytest's skips are BaseExceptions,
                raise                     # not caught below: none of them is a failure
            except Exception:
                self.failed = True
                raise

        watched._watched_by = self
        handle.inner_test = watched

    def summary(self) -> str:
        return "; ".join(f"{count}x {self.first[general]}" for general, count in self.reasons.most_common())

    def note(self) -> str:
        stopped = ", and drawing stopped there" if self.total() >= self.REFUSAL_BUDGET else ""
        return (f"{self.ran()} examples ran; {self.total()} drawn examples torch's library cannot run were not"
                f"{stopped}, as: {self.summary()}")


_STATE = pytest.StashKey[RunState]()


def _pool_options(config) -> dict:
    """What every pool of the session shares: deadlines, containment, the coverage record."""
    state = config.stash[_STATE]
    return dict(timeout_s=config.getoption("--rank-timeout"), on_run=state.world_sizes.add, contain=_contain(config),
                live_ranks=state.live_ranks,
                time_left=state.budget.left if state.budget.deadline is not None else None)


@pytest.fixture(scope="session")
def world_pool(target, pytestconfig):
    attach = _attach(pytestconfig)
    key = os.environ.get("CONFORMANCE_AUTHKEY")
    pool = WorldPool(target.plan, attach=attach, authkey=bytes.fromhex(key) if key else None,
                     **_pool_options(pytestconfig))
    if attach is not None:
        capture = pytestconfig.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print(f"\n[conformance] worlds of {attach.size} ranks run on attached ranks; waiting up to "
                  f"{attach.timeout_s:g} s for them. On each host, from this repository's root:\n  "
                  f"{pool.attach_command()}\n", file=sys.stderr, flush=True)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def audited_pool(target, pytestconfig):
    """Worlds whose ranks record every communication call (harness/rank/recording.py), for the audit;
    the same backend per world size and the same caps as world_pool."""
    pool = WorldPool(target.plan, audit=True, **_pool_options(pytestconfig))
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _per_test_records(request):
    """Clears what the driver records per test (world sizes, refusals) before it starts."""
    state = request.config.stash[_STATE]
    state.world_sizes.clear()
    state.refusals.clear()
    state.refusals.watch_failures(request.function)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Fails the test before any of its fixtures runs (a session fixture may start worlds) when the
    time budget is spent or its capability already hung in an earlier test (each hang costs a whole
    deadline)."""
    marker = item.get_closest_marker("capability")
    state = item.config.stash.get(_STATE, None)
    if marker is None or state is None:
        return
    capability = marker.args[0]
    if state.budget.spent():
        pytest.fail(f"not run: the time budget of {state.budget.seconds:g} s (--time-budget) was spent before this "
                    "test started", pytrace=False)
    if capability in state.hung:
        pytest.fail(f"not run: {capability} already hung in {state.hung[capability]} (that test shows every "
                    "rank's stack); the rest of its tests are not run, each would wait out a deadline", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Records the world sizes the test ran on. A test that passed on 1-rank worlds only, in a run
    where no larger world can be drawn, has tested nothing distributed: it is reported as skipped
    with the reason, never as passed."""
    state = item.config.stash.get(_STATE, None)
    sizes = sorted(state.world_sizes) if state is not None and call.when == "call" else []
    if sizes:
        item.user_properties.append(("world_sizes", ",".join(map(str, sizes))))
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and call.excinfo is not None and call.excinfo.errisinstance(RanksHung):
        capability = next((value for key, value in item.user_properties if key == "capability"), None)
        if capability is not None and state is not None:
            state.hung.setdefault(capability, item.nodeid)
    refusals = state.refusals if state is not None and call.when == "call" else None
    if refusals is not None and call.excinfo is not None and call.excinfo.errisinstance(EnoughRefused):
        report.outcome, report.longrepr = "passed", None  # every example it ran passed; it stopped drawing
    if refusals is not None and refusals.reasons and report.passed:
        item.user_properties.append(("note", refusals.note()))
    plan = item.config.stash.get(_PLAN, None)
    if report.passed and sizes and max(sizes) < 2 and plan is not None and not plan.multi_rank():
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           f"not tested: only 1-rank worlds ran ({plan.coverage()})")


class Ranks:
    """Runs a rank program on the members of a group inside a persistent world and returns what
    each member produced, keyed by global rank. Non-members take part in creating the group only."""

    def __init__(self, pool: WorldPool, target: Target, refusals: Refusals | None = None):
        self.pool = pool
        self.target = target
        self.refusals = refusals if refusals is not None else Refusals()

    def run(self, world_size: int, members, program: str, per_member: list[dict], timeout_s: float | None = None) -> dict:
        __tracebackhide__ = True
        ranks = list(members) if members is not None else list(range(world_size))
        if len(per_member) != len(ranks):
            raise ValueError(f"{len(per_member)} argument sets for {len(ranks)} members")
        group = list(members) if members is not None else None
        args = [{"group": group} for _ in range(world_size)]
        for rank, kwargs in zip(ranks, per_member):
            args[rank] = {**kwargs, "group": group}
        if not program.startswith("harness.rank.programs."):
            program = f"harness.rank.programs.{program}"
        result = self.pool.run(world_size, program, args, impl=self.target.impl, timeout_s=timeout_s)
        self._last_world = world_size
        return {rank: result.outputs[rank] for rank in ranks}

    def disagreements(self) -> list[str]:
        """What the flight recorders of the last task's ranks say (harness/driver/disagreement.py), for a
        verdict that failed on values the ranks returned (a same-size dtype mismatch garbles data
        silently)."""
        size = getattr(self, "_last_world", None)
        return self.pool.disagreements(size) if size is not None else []


@pytest.fixture(scope="session")
def ranks(world_pool, target, pytestconfig) -> Ranks:
    return Ranks(world_pool, target, pytestconfig.stash[_STATE].refusals)


@dataclass(frozen=True)
class BackendRefusals:
    """What the backend's own collectives refuse, probed once: {(collective, dtype, op): message}."""

    backend: str
    refused: dict

    def dtypes(self, collective: str, op: str | None = None) -> frozenset:
        import torch

        return frozenset(getattr(torch, d) for (c, d, o), _ in self.refused.items() if c == collective and o == op)

    def cases(self, collective: str) -> list[tuple[str, str | None, str]]:
        return sorted(((d, o, m) for (c, d, o), m in self.refused.items() if c == collective), key=str)


@pytest.fixture(scope="session")
def backend_refusals(world_pool, target) -> BackendRefusals:
    """Probed on each backend of the plan, at its smallest world of two ranks or more (else its
    one world); a case any of them refuses is not drawn (the message names the backend)."""
    from reference.collectives import DTYPES, OPS, op_applies

    reductions = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
    others = ("broadcast", "scatter", "gather", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_uneven",
              "all_to_all_single")
    cases = [(c, str(d).removeprefix("torch."), op) for c in reductions for d in DTYPES for op in OPS if op_applies(op, d)]
    cases += [(c, str(d).removeprefix("torch."), None) for c in others for d in DTYPES]
    refused, refusing = {}, []
    for backend in target.plan.backends():
        sizes = target.plan.sizes(backend)
        n = next((size for size in sizes if size >= 2), sizes[0])
        probe = world_pool.run(n, "harness.rank.programs.probe:native_refusals", [{"cases": cases}] * n, impl="torch.distributed")
        found = {case: f"{backend}: {message}" for case, message in probe.outputs[0].items() if message is not None}
        refusing += [backend] if found else []
        refused = {**found, **refused}
    return BackendRefusals(" and ".join(refusing) or "/".join(target.plan.backends()), refused)
