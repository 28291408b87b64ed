"""The audit's fixture: an Audited runner over the session's audited pool."""

from __future__ import annotations

import pytest

from parallelism_conformance.conformance.audit.common import Audited, p2p_required
from parallelism_conformance.harness.driver.plugin.options import bounds_required
from parallelism_conformance.harness.driver.plugin.state import STATE


@pytest.fixture(scope="session")
def audited(audited_pool, target, pytestconfig, backend_refusals, ranks):
    return Audited(
        audited_pool,
        target,
        p2p_required(target.impl, pytestconfig.getoption("--audit-require-p2p")),
        backend_refusals,
        ranks.refusals,
        require_bounds=bounds_required(pytestconfig),
        costs=pytestconfig.stash[STATE].costs,
    )
