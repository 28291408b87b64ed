"""Parallelize functions for ``--parallelize``: plans built on torch's own ``fully_shard`` and
``parallelize_module`` that must pass (good.py), and plans with a bug teams reported that must fail,
named (bad.py). tests/test_parallelize.py runs both."""
