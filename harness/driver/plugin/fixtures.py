"""The session's fixtures: the world pools (plain and audited), ``target`` and ``ranks`` (a rank
program run on a group's members). What the backend's own collectives refuse is probed by
conformance/conftest.py, which calls them as conformance/collective_table.py says."""

from __future__ import annotations

import os
import sys

import pytest

from parallelism_conformance.harness.driver import perturbation
from parallelism_conformance.harness.driver.plugin.contain import contained
from parallelism_conformance.harness.driver.plugin.options import attached_world, declared_designs, library_of, perturb_timing
from parallelism_conformance.harness.driver.plugin.profiles import current_profile
from parallelism_conformance.harness.driver.plugin.refusals import Refusals
from parallelism_conformance.harness.driver.plugin.state import STATE, Designs, Target, backend_plan
from parallelism_conformance.harness.driver.pool import WorldPool


def pool_options(config) -> dict:
    """What every pool of the session shares: deadlines, containment, the coverage record."""
    state = config.stash[STATE]
    return dict(
        timeout_s=config.getoption("--rank-timeout"),
        on_run=state.world_sizes.add,
        contain=contained(config),
        live_ranks=state.live_ranks,
        time_left=state.budget.left if state.budget.deadline is not None else None,
    )


@pytest.fixture(scope="session")
def target(pytestconfig) -> Target:
    plan = backend_plan(pytestconfig)
    profile = current_profile()
    attach, attach_options = attached_world(pytestconfig), ""
    if attach is not None:
        attach_options = f" --attach {attach.size} --attach-address {attach.host}:{attach.port}"
    return Target(
        pytestconfig.getoption("--impl"),
        pytestconfig.getoption("--backend"),
        plan.max_world_size,
        profile,
        attach_options,
        plan,
        pytestconfig.getoption("--scope"),
        perturb_timing(pytestconfig),
    )


@pytest.fixture
def reproduce(target, request) -> str:
    """The command that reruns this test alone, printed with every failure (conformance.verdict.Judge)."""
    return target.reproduce(request.node.nodeid)


@pytest.fixture(scope="session")
def world_pool(target, pytestconfig):
    attach = attached_world(pytestconfig)
    key = os.environ.get("CONFORMANCE_AUTHKEY")
    pool = WorldPool(
        target.plan, attach=attach, authkey=bytes.fromhex(key) if key else None, perturb=target.perturb != "off", **pool_options(pytestconfig)
    )
    if attach is not None:
        capture = pytestconfig.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print(
                f"\n[conformance] worlds of {attach.size} ranks run on attached ranks; waiting up to "
                f"{attach.timeout_s:g} s for them. On each host, from this repository's root:\n  "
                f"{pool.attach_command()}\n",
                file=sys.stderr,
                flush=True,
            )
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def audited_pool(target, pytestconfig):
    """Worlds whose ranks record every communication call (harness/rank/recording.py), for the audit;
    the same backend per world size and the same caps as world_pool."""
    # ranks talk through the driver's relay, which is the audit's evidence (harness/driver/relay.py):
    # every implementation but a training library's adapter, whose own launcher and communication
    # layer the matrix runs as its users do (scripts/libraries), on gloo with records
    relay = library_of(target.impl) is None
    pool = WorldPool(target.plan, audit=True, relay=relay, **pool_options(pytestconfig))
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _per_test_records(request):
    """Clears what the driver records per test (world sizes, refusals, costs-more findings) before it
    starts, and starts its share of the time budget."""
    state = request.config.stash[STATE]
    state.world_sizes.clear()
    state.refusals.clear()
    state.costs.clear()
    state.designs.clear()
    items = request.session.items
    state.share.start(len(items) - items.index(request.node) if request.node in items else 1)
    state.refusals.watch_failures(request.function, after_passed=state.share.check)


class Ranks:
    """Runs a rank program on the members of a group inside a persistent world and returns what
    each member produced, keyed by global rank. Non-members take part in creating the group only."""

    def __init__(self, pool: WorldPool, target: Target, refusals: Refusals | None = None, designs: Designs | None = None, library=None):
        self.pool = pool
        self.target = target
        self.refusals = refusals if refusals is not None else Refusals()
        self.designs = designs if designs is not None else Designs()  # what the library under test declares
        # the training library whose adapter is under test (harness/driver/libraries/table.py), or None;
        # where it declares configuration keys, every task tells the adapter the current test's draw
        self.library = library
        self.configuration: dict = {}  # {dotted key: value} the current test drew ({}: the library's defaults)

    def micro_batch_scale(self, micro_batches: int) -> float:
        """What the reference multiplies each micro-batch's loss by: 1 (the contract sums the k
        micro-batches' gradients), or 1/k for a library that divides each loss by its own count
        (DeepSpeed's gradient_accumulation_steps: the table's ``averages_micro_batches``)."""
        return 1.0 / micro_batches if self.library is not None and self.library.averages_micro_batches else 1.0

    def run(self, world_size: int, members, program: str, per_member: list[dict], timeout_s: float | None = None) -> dict:
        __tracebackhide__ = True
        ranks = list(members) if members is not None else list(range(world_size))
        if len(per_member) != len(ranks):
            raise ValueError(f"{len(per_member)} argument sets for {len(ranks)} members")
        group = list(members) if members is not None else None
        told = {"library_configuration": dict(self.configuration)} if self.library is not None and self.library.settings else {}
        args = [{"group": group, **told} for _ in range(world_size)]
        for rank, kwargs in zip(ranks, per_member):
            args[rank] = {**kwargs, "group": group, **told}
        if not program.startswith("parallelism_conformance.harness.rank.programs."):
            program = f"parallelism_conformance.harness.rank.programs.{program}"
        schedules = perturbation.draw(world_size, every_call=self.target.perturb == "every") if self.pool.perturb else None
        self._late = []
        result = self.pool.run(world_size, program, args, impl=self.target.impl, timeout_s=timeout_s, schedules=schedules)
        self._last_world, self._late = world_size, result.late
        if schedules is not None:
            read_early = perturbation.poisoned_reads(result.outputs, result.late, schedules)
            if read_early is not None:
                raise perturbation.ReadBeforeCompletion(read_early)
        return {rank: result.outputs[rank] for rank in ranks}

    def late_note(self) -> str:
        """For a verdict that failed on values under --perturb-timing: the last task's calls that had
        not completed when its program returned (harness/driver/perturbation.py)."""
        return perturbation.late_note(getattr(self, "_late", []))

    def disagreements(self) -> list[str]:
        """What the flight recorders of the last task's ranks say (harness/driver/disagreement.py), for a
        verdict that failed on values the ranks returned (a same-size dtype mismatch garbles data
        silently)."""
        size = getattr(self, "_last_world", None)
        return self.pool.disagreements(size) if size is not None else []


@pytest.fixture(scope="session")
def ranks(world_pool, target, pytestconfig) -> Ranks:
    state = pytestconfig.stash[STATE]
    library = None if current_profile() == "grading" else library_of(pytestconfig.getoption("--impl"))
    return Ranks(world_pool, target, state.refusals, Designs(declared_designs(pytestconfig), state.designs), library)
