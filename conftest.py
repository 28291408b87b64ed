"""Top-level pytest configuration: the harness's options, fixtures and scorecard."""
pytest_plugins = ["harness.driver.pytest_plugin"]
