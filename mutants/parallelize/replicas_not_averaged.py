"""Data parallelism across dp_replicate with no gradient all-reduce: each replica steps on its own rows' gradient (parallelize_examples/bad.py).
targets: step_by_step and dp_replicate2
"""

from parallelism_conformance.parallelize_examples.bad import replicas_not_averaged as parallelize  # noqa: F401
