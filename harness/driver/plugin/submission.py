"""The submission read by the driver (harness/driver/submission/), and what the rubric makes of it:
read once at the session's start, in the pytest process, before any rank starts (the ranks load
the implementation only inside a test), so nothing the code under test does can change it.

* A reach into the grader (an import of the suite, sys.modules, gc, ctypes, importlib, builtins,
  exec/eval/compile, a write on an imported module) flags every test for review in results.json,
  seen by staff and student (``--reject-grader-access``: every test scores 0, saying why).
* A capability the submission takes from the suite's bundled implementations (imported, wrapped or
  copied) scores 0 before its tests run, saying why (``--bundled-code``: reject under the grading
  profile; reported only under the others, and for the project's own implementations in its
  checkout (mutants, fixtures, outsiders), which import the bundled code by design).
"""

from __future__ import annotations

import os

import pytest

from parallelism_conformance.harness.driver.plugin.profiles import current_profile
from parallelism_conformance.harness.driver.submission.reading import Reading, read, the_projects_own

READING = pytest.StashKey[Reading]()


def pytest_addoption(parser):
    group = parser.getgroup("conformance")
    group.addoption(
        "--reject-grader-access",
        action="store_true",
        default=False,
        help="a submission whose own files reach into the grader (import the suite's modules, use sys.modules, gc, "
        "ctypes, importlib, builtins, exec/eval/compile, write on an imported module) scores 0 on every test, saying "
        "why (default: each test is flagged for review in results.json, for staff and student)",
    )
    group.addoption(
        "--bundled-code",
        default="auto",
        choices=("auto", "reject", "report"),
        help="a capability the submission takes from the suite's bundled implementations or adapters (imported, "
        "wrapped or copied) scores 0, saying why (reject), or is only reported (report); auto: reject under the "
        "grading profile, except for the project's own mutants, fixtures and outsiders; report otherwise",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Read the submission (after Hypothesis has loaded the profile), before any test and any rank."""
    config = session.config
    option, impl, env = config.getoption("--bundled-code"), config.getoption("--impl"), dict(os.environ)
    if not (
        current_profile() == "grading" or config.getoption("--report-dir") or option == "reject" or config.getoption("--reject-grader-access")
    ):
        return  # no verdict nor grading file could use it: the mutation runner's hundreds of runs skip the 0.5 s
    graded = current_profile() == "grading" and not the_projects_own(impl, env, os.getcwd())
    reading = read(
        impl,
        env,
        os.getcwd(),
        reject_reaches=config.getoption("--reject-grader-access"),
        reject_bundled=option == "reject" or (option == "auto" and graded),
    )
    config.stash[READING] = reading
    grading_files = config.pluginmanager.get_plugin("conformance-grading-files")
    if grading_files is not None and (reading.files or reading.unread):
        grading_files.run["submission"] = reading.as_data()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test whose capability the reading scores 0 fails before its fixtures start any rank."""
    reading = item.config.stash.get(READING, None)
    marker = item.get_closest_marker("capability")
    if reading is not None and marker is not None:
        why = reading.rejection(marker.args[0])
        if why:
            pytest.fail(why, pytrace=False)


def pytest_terminal_summary(terminalreporter):
    reading = terminalreporter.config.stash.get(READING, None)
    lines = reading.lines() if reading is not None else []
    if lines:
        terminalreporter.section("the submission, as the driver read it")
        for line in lines:
            terminalreporter.write_line(line)
