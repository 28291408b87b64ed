"""Known-buggy tensor-parallel implementations (conformance/test_tensor_parallel.py must fail each)."""
