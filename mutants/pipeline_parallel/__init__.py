"""Known-buggy pipeline parallelism: each must fail conformance/test_pipeline_parallel.py."""
