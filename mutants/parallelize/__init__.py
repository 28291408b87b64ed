"""Known-bad parallelize functions (capability ``parallelize``): each file's ``parallelize`` is
graded through ``--parallelize mutants/parallelize/<file>.py:parallelize`` by the mutation runner."""
