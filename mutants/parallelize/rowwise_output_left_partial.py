"""The SwiGLU's down projection row-parallel with its output left Partial: each tp rank adds its own partial product to the residual stream, never the all-reduced sum (parallelize_examples/bad.py).
targets: step_by_step and tp2
"""

from parallelism_conformance.parallelize_examples.bad import rowwise_output_left_partial as parallelize  # noqa: F401
