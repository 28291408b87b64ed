"""The SwiGLU's down projection left out of the tensor-parallel plan: a whole nn.Linear fed each tp rank's ffn / tp columns, a shape error on the ranks (parallelize_examples/bad.py).
targets: step_by_step and tp2
"""

from parallelism_conformance.parallelize_examples.bad import down_projection_left_replicated as parallelize  # noqa: F401
