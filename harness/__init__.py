"""The machinery that runs ranks: persistent worlds, the rank loop, loading the implementation
under test inside ranks, and the safe wire between ranks and the driver.

Nothing outside this package starts processes. The driver (the pytest process) never imports the
implementation under test: it sends each rank a task naming a rank program (harness.programs.*)
and that rank's inputs, and receives that rank's outputs; the verdict is computed in the driver.
"""
