"""The machinery that runs ranks, in two packages split by the process boundary:

* ``harness.rank``: what runs inside a rank process, next to the implementation under test (the
  rank loop, the loader, the rank programs, the recorders, the wire). It never imports the driver,
  the oracle, the tests or the grading code.
* ``harness.driver``: what runs only in the pytest process (worlds and pools, the audit's rules, the
  capability registry, the plugin, the scorecard and reports, the mutation runner).

Nothing outside this package starts processes. The driver never imports the implementation under
test: it sends each rank a task naming a rank program (``harness.rank.programs.*``) and that rank's
inputs, and receives that rank's outputs; the verdict is computed in the driver.
"""
