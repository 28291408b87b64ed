"""Top-level pytest configuration: the harness's options, fixtures and scorecard."""

from parallelism_conformance.harness.driver.plugin import PLUGINS as pytest_plugins  # noqa: F401 - pytest reads the name
