"""Benchmarks: run with scripts/bench (pytest-benchmark). Each prints the ratio it gates on."""
