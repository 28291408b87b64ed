"""``python -m parallelism_conformance.harness.rank``: a rank started by another launcher (torchrun, on this host or another),
configured from the environment the driver's attach command names (harness.driver.pool.Attach)."""

from parallelism_conformance.harness.rank.loop import _config_from_environment, serve

serve(_config_from_environment())
