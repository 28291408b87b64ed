"""Single-process ground truth for the collectives conformance suite.

Pure functions over a Python list of per-rank tensors (index = rank) that
return the list of per-rank results. This package never imports torch's
distributed package (not even its ReduceOp enum): ops are plain strings.
"""
