"""The harness's pytest plugins as one ``-p`` name, for runs without the checkout's conftest.py (the
installed command, parallelism_conformance/cli.py, which reads no ini file)."""

from parallelism_conformance.harness.driver.plugin import PLUGINS

pytest_plugins = PLUGINS
