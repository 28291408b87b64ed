"""What every audit test shares: the audited runner (the ordinary run, then the kernel's write
counts checked against the records), the skip of an unclaimed strategy, and the verdict."""

from __future__ import annotations

import pytest

from parallelism_conformance.conformance.examples import Layout
from parallelism_conformance.conformance.verdict import Judge, adapter_cannot
from parallelism_conformance.harness.driver import audit, relay_verdicts
from parallelism_conformance.harness.driver.failures import TASK_FAILURES, ImplementationIncomplete
from parallelism_conformance.harness.driver.plugin.options import claimed
from parallelism_conformance.harness.driver.pool import WorldPool

CALL = "parallelism_conformance.harness.rank.programs.collectives:call"
OPS = ("SUM", "MAX")  # the reduction does not change the traffic; both apply to every dtype
EXEMPT_FROM_P2P = ("torch.distributed", "parallelism_conformance.adapters")  # torch's own collectives, and modules built on them


def p2p_required(impl: str, option: str) -> bool:
    """--audit-require-p2p: "yes", "no", or "auto" (every implementation but torch.distributed and
    adapters.*)."""
    if option != "auto":
        return option == "yes"
    return not any(impl == name or impl.startswith(name + ".") for name in EXEMPT_FROM_P2P)


class Audited:
    """Runs a rank program on the members of a layout in an audited world; returns the members'
    outputs and every rank's records (non-members too: they must send nothing)."""

    def __init__(self, pool: WorldPool, target, require_p2p: bool, refusals, adapter_refusals, require_bounds: bool = True, costs=None):
        self.pool, self.target, self.require_p2p = pool, target, require_p2p
        self.require_bounds = require_bounds  # --require-bounds: a cost above the bound fails, else it is reported
        self.costs = costs if costs is not None else []  # the current test's costs-more findings (RunState.costs)
        self.refusals = refusals  # what the backends' own collectives refuse (probed): not drawn (None: nothing)
        # what the project's adapters say torch's library cannot run (the test's Refusals, as
        # conformance.verdict.run_or_skip uses them): an example rejected, another drawn
        self.adapter_refusals = adapter_refusals

    def refused_dtypes(self, name: str, op: str | None) -> frozenset:
        return self.refusals.dtypes(name, op) if self.refusals is not None else frozenset()

    def run(self, judge: Judge, layout: Layout, program: str, per_member: list[dict]):
        __tracebackhide__ = True
        # check() reads the bound policy from the judge: the tests' own source stays as it is (a
        # derandomized profile draws from each test's source; an edit would change its examples)
        judge.audited = self
        args = [{"group": layout.group} for _ in range(layout.world_size)]
        for rank, kwargs in zip(layout.ranks, per_member):
            args[rank] = {**kwargs, "group": layout.group}
        try:
            result = self.pool.run(layout.world_size, f"parallelism_conformance.harness.rank.programs.{program}", args, impl=self.target.impl)
        except ImplementationIncomplete as incomplete:
            reason = adapter_cannot(self.target.impl, incomplete)
            if reason:
                self.adapter_refusals.refuse(reason, judge)  # rejects, skips or stops: never returns
            incomplete.add_note(f"  example: {judge.example}\n  reproduce: {judge.reproduce}")
            raise
        except TASK_FAILURES as failure:
            failure.add_note(f"  example: {judge.example}\n  reproduce: {judge.reproduce}")
            raise
        self.adapter_refusals.ran_task(judge)
        written = dict(enumerate(result.bytes_written))
        if result.relayed is not None:  # a relay world: what the driver carried is the evidence, the ranks' records are not
            records = result.relayed.records
            accounted = relay_verdicts.accounted(result.relayed, written, audit.FIXED)
        else:
            records = dict(enumerate(result.records))
            accounted = audit.accounted(records, written)
        # on every audited task; evidence withheld (counts the driver could not read) fails, never skips
        check(judge, [*filter(None, result.bytes_unread), *accounted])
        return {r: result.outputs[r] for r in layout.ranks}, records


def check(judge: Judge, violations: list[str]) -> None:
    """The audit's verdict. A broken rule (a collective where point-to-point is required, a gather in
    the wrong dtype, bytes the records do not explain) is *wrong*: a failure, always, named first.
    Bytes above the theory's bound (audit.Cost) are *costs more*: a failure where bounds are required
    (--require-bounds), otherwise the test passes with the finding and its ratio reported apart."""
    wrong = [v for v in violations if not isinstance(v, audit.Cost)]
    costs = [v for v in violations if isinstance(v, audit.Cost)]
    audited = getattr(judge, "audited", None)
    if wrong:
        also = "\n  and it costs more than the theory's bound:\n  " + "\n  ".join(costs) if costs else ""
        judge.fail("communication audit:\n  " + "\n  ".join(wrong) + also)
    if costs and (audited is None or audited.require_bounds):
        judge.fail("communication audit, costs more than the theory's bound (--require-bounds):\n  " + "\n  ".join(costs))
    if costs:
        audited.costs.extend(f"costs more ({judge.example}): {cost}" for cost in costs)


def audits(request, capability: str) -> None:
    """The audit of a strategy runs when the implementation claims that strategy (--capability);
    otherwise it is skipped, by the driver's option alone. A claimed strategy whose names are
    missing fails as not implemented, whatever the ranks say."""
    if capability not in claimed(request.config):
        pytest.skip(f"{capability} is not claimed (--capability): nothing of it to audit")


PIPELINE_METADATA_BYTES = 128  # per activation or gradient message: its shape and dtype, if a runtime sends them

# the models of the data-parallel, ZeRO and FSDP audits
DP_MODELS = {
    # fc1.weight frozen (768 items) is far larger than the trainable rest (131 items): reducing it
    # cannot hide in the rounding allowance.
    "mlp_frozen_fc1": ({"kind": "mlp", "inputs": 24, "hidden": 32, "outputs": 3}, ["fc1.weight"]),
    # tied weights (reduced once), a frozen gain, buffers
    "tied_lm": ({"kind": "tied_lm", "vocab": 11, "width": 8, "hidden": 12, "context": 3}, []),
}
