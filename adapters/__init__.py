"""Adapters: modules that expose a third-party library through the suite's contract, so
``--impl parallelism_conformance.adapters.<name>`` grades that library like any implementation under test."""
