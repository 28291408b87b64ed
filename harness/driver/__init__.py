"""The driver side: what runs only in the pytest process, out of reach of the code under test.

Worlds of ranks and their pools (world.py, pool.py), the backend per world size (backends.py), the
failures a task can end in (failures.py, disagreement.py), the communication audit's rules
(audit.py), the capability registry (capabilities.py), the pytest plugin (plugin/), the
scorecard and grading reports (scorecard.py, reports.py) and the mutation runner (mutation.py).

Verdicts, scores and audit figures are computed here, from what ranks sent back and from
``reference``; nothing here is imported by a rank (tests/test_layering.py).
"""
