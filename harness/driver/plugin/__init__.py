"""The pytest side of the harness, one job per module, loaded by the top-level conftest.py:

* profiles.py: the Hypothesis profiles (quick, ci, thorough, grading, mutation, brief);
* options.py: the suite's command-line options, checked once, and what they select;
* state.py: what the driver keeps about the session (the target, the backend plan, the budget);
* contain.py: whether ranks run contained, decided before any rank starts;
* refusals.py: what torch's library or the backend cannot run, rejected instead of failed;
* time_share.py: under a time budget, each test's share of it (examples cut, never whole tests);
* strata.py: each test's declared strata, run before its draws (a slow one fails on time, named);
* grading_files.py: results.json, junit.xml and summary.txt, written as the run goes;
* submission.py: the submission read by the driver before any rank starts, and what it costs;
* hooks.py: the session's hooks (scorecard, deselection, the budget, outcomes);
* fixtures.py: the world pools and the ``ranks`` and ``target`` fixtures (``backend_refusals`` is
  conformance/conftest.py's: it calls the collectives from conformance/collective_table.py).
"""

PLUGINS = [f"parallelism_conformance.harness.driver.plugin.{name}" for name in ("options", "hooks", "submission", "fixtures", "strata")]
