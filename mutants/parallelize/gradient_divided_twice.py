"""FSDP2 on dp_shard with the gradient divided twice: FSDP's own average and a divide factor set on top (a manual division by dp applied again; parallelize_examples/bad.py).
targets: step_by_step and dp_shard2
"""

from parallelism_conformance.parallelize_examples.bad import gradient_divided_twice as parallelize  # noqa: F401
