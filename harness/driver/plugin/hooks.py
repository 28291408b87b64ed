"""The session's hooks: the scorecard and grading files set up, tests of unclaimed capabilities
deselected, a test not started once the budget is spent or its capability hung, and outcomes
rewritten where a pass would say more than was tested."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallelism_conformance.harness.driver.failures import ContainerMemory, RanksHung
from parallelism_conformance.harness.driver.plugin import profiles  # noqa: F401 - registers the profiles before Hypothesis loads one
from parallelism_conformance.harness.driver.plugin.contain import CONTAINED, containment_note, decide_containment
from parallelism_conformance.harness.driver.plugin.grading_files import GradingFiles, junit_key
from parallelism_conformance.harness.driver.plugin.nondeterminism import is_flaky, nondeterminism_report
from parallelism_conformance.harness.driver.plugin.options import SCOPES, check_options, claimed, library_of
from parallelism_conformance.harness.driver.plugin.profiles import current_profile
from parallelism_conformance.harness.driver.plugin.refusals import EnoughRefused
from parallelism_conformance.harness.driver.plugin.state import PLAN, STATE, Budget, RunState, backend_plan, live_ranks
from parallelism_conformance.harness.driver.plugin.time_share import ShareSpent
from parallelism_conformance.harness.driver.reports import older_torch_warning
from parallelism_conformance.harness.driver.rubric import load_rubric
from parallelism_conformance.harness.driver.scorecard import COSTS_MORE, DIFFERS_BY_DESIGN, Scorecard


def pytest_report_header(config):
    import torch

    warning = older_torch_warning(torch.__version__)
    return [f"WARNING: {warning}"] if warning else []


# torch's own FutureWarnings (deprecations the code under test triggers are not the suite's findings),
# and the one NumPy prints where it is absent: set here, not in an ini file, so every run has them
WARNINGS_IGNORED = ("ignore::FutureWarning", "ignore:Failed to initialize NumPy")


@pytest.hookimpl(tryfirst=True)  # before the junitxml plugin reads its path
def pytest_configure(config):
    config.addinivalue_line("markers", "capability(name): the capability a test grades (scorecard row)")
    config.addinivalue_line("markers", "min_ranks(n): skipped, in the driver, where no world of n ranks can be drawn")
    config.addinivalue_line("markers", "library_configuration: draws a listed library's configuration; collected for its adapter only")
    for ignored in WARNINGS_IGNORED:
        config.addinivalue_line("filterwarnings", ignored)
    check_options(config)
    report_dir = config.getoption("--report-dir")
    import torch

    config.stash[CONTAINED] = decide_containment(config)
    scorecard = Scorecard(
        config,
        coverage=lambda: backend_plan(config).coverage() + SCOPES[config.getoption("--scope")] + containment_note(config),
        warning=older_torch_warning(torch.__version__),
    )
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


def pytest_collection_modifyitems(config, items):
    """Tests of capabilities the implementation does not claim (--capability) are not run. Each kept
    test is tagged with its capability here, before any fixture runs, so that a test whose session
    fixture fails at setup (a probe that crashed, a budget spent) is still reported for its capability."""
    chosen = claimed(config)
    # a library's configuration draws exist only for a listed library's adapter, never under grading
    # (conformance/library_configurations.py): for any other implementation they are not collected
    library = current_profile() != "grading" and library_of(config.getoption("--impl")) is not None
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("capability")
        dropped = marker is not None and marker.args[0] not in chosen
        dropped = dropped or (not library and item.get_closest_marker("library_configuration") is not None)
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
    session.config.stash[STATE] = RunState(Budget(session.config), live_ranks(session.config))
    key = junit_key()
    xml = session.config.stash.get(key, None) if key is not None else None
    if xml is not None:
        xml.add_global_property("coverage", backend_plan(session.config).coverage())
        xml.add_global_property("implementation", session.config.getoption("--impl"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any of its fixtures runs (a session fixture may start worlds): skips a test that needs
    more ranks than this run draws (min_ranks), and fails one when the time budget is spent or its
    capability already hung in an earlier test (each hang costs a whole deadline)."""
    fewest = item.get_closest_marker("min_ranks")
    largest = backend_plan(item.config).max_world_size
    if fewest is not None and largest < fewest.args[0]:
        pytest.skip(
            f"needs a world of at least {fewest.args[0]} ranks; this run draws at most {largest} "
            "(--max-world-size, or the GPUs visible under --backend nccl)"
        )
    marker = item.get_closest_marker("capability")
    state = item.config.stash.get(STATE, None)
    if marker is None or state is None:
        return
    capability = marker.args[0]
    if state.budget.spent():
        pytest.fail(f"not run: the time budget of {state.budget.seconds:g} s (--time-budget) was spent before this test started", pytrace=False)
    if capability in state.hung:
        pytest.fail(
            f"not run: {capability} already hung in {state.hung[capability]} (that test shows every "
            "rank's stack); the rest of its tests are not run, each would wait out a deadline",
            pytrace=False,
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Records the world sizes the test ran on. A test that passed on 1-rank worlds only, in a run
    where no larger world can be drawn, has tested nothing distributed: it is reported as skipped
    with the reason, never as passed."""
    state = item.config.stash.get(STATE, None)
    sizes = sorted(state.world_sizes) if state is not None and call.when == "call" else []
    if sizes:
        item.user_properties.append(("world_sizes", ",".join(map(str, sizes))))
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and call.excinfo is not None and call.excinfo.errisinstance(RanksHung):
        capability = next((value for key, value in item.user_properties if key == "capability"), None)
        if capability is not None and state is not None:
            state.hung.setdefault(capability, item.nodeid)
    if call.when == "call" and call.excinfo is not None and is_flaky(call.excinfo.value):
        report.longrepr = nondeterminism_report(call.excinfo.value, item)  # never Hypothesis's raw FlakyFailure
    refusals = state.refusals if state is not None and call.when == "call" else None
    if refusals is not None and call.excinfo is not None and call.excinfo.errisinstance((EnoughRefused, ShareSpent)):
        report.outcome, report.longrepr = "passed", None  # every example it ran passed; it stopped drawing
    if call.when == "call" and call.excinfo is not None and call.excinfo.errisinstance(ContainerMemory):
        # the container's memory, not the implementation: neither for nor against (reports.py: NOT_GRADED)
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, str(call.excinfo.value))
    notes = []
    if call.when == "call" and state is not None:
        notes += state.memory_kills_since_last()
    for findings, verdict in ((state.designs, DIFFERS_BY_DESIGN), (state.costs, COSTS_MORE)) if call.when == "call" and state else ():
        if findings and report.passed:  # each its own verdict, never "fail" nor a plain "pass"
            notes += findings
            item.user_properties.append(("verdict", verdict))
            report.user_properties.append(("verdict", verdict))
    if call.when == "call" and state is not None and state.share.stopped and report.passed:
        notes.append(state.share.stopped)
    if refusals is not None and refusals.reasons and report.passed:
        notes.append(refusals.note())
    for note in notes:  # the report holds a copy of the item's properties, made before this
        item.user_properties.append(("note", note))
        report.user_properties.append(("note", note))
    plan = item.config.stash.get(PLAN, None)
    if report.passed and sizes and max(sizes) < 2 and plan is not None and not plan.multi_rank():
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"not tested: only 1-rank worlds ran ({plan.coverage()})")
