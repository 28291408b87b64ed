"""Known-buggy implementations: the suite must fail every one of them (see harness/driver/mutation.py).
Each file's docstring says its bug in the first line and, on a 'targets:' line, the pytest -k
expression that selects the tests expected to catch it."""
