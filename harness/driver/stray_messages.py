"""The stray-message check after a task on gloo (harness.rank.programs.probe: stray_messages): a
message the implementation sent and nobody received would otherwise be taken by the next test's
receive, and blamed on it. Driver side; run by World.run after every task every rank finished."""

from __future__ import annotations

from parallelism_conformance.harness.driver.failures import TASK_FAILURES, RankFailure, RankReport, RanksCrashed

STRAY_CHECK = "parallelism_conformance.harness.rank.programs.probe:stray_messages"
STRAY_CHECK_TIMEOUT_S = 20.0  # every rank is idle by then: the exchange takes milliseconds


def check(world, program: str, impl: str, timeout_s: float, grace_s: float) -> None:
    __tracebackhide__ = True
    what = f"{program} on {world.size} ranks finished, but the stray-message check after it"
    try:
        probe = world._run(STRAY_CHECK, [{}] * world.size, impl=impl, timeout_s=min(timeout_s, STRAY_CHECK_TIMEOUT_S), grace_s=grace_s)
    except TASK_FAILURES as failure:
        world.close()
        inner = failure if isinstance(failure, RankFailure) else failure.failure
        raise RanksCrashed(
            RankFailure(
                f"{what} failed: a receive the implementation posted and never matched takes the "
                f"check's message (the check then hangs), and a leftover message over 64 KiB aborts "
                f"it; this world is rebuilt for the next test.\n{inner.summary}",
                inner.ranks,
            )
        ) from None
    leftovers = {rank: out["leftovers"] for rank, out in enumerate(probe.outputs) if out["leftovers"]}
    if leftovers:
        world.close()
        found = "; ".join(
            f"rank {peer} -> rank {rank} (first int64 words {words})" for rank, by_peer in leftovers.items() for peer, words in by_peer.items()
        )
        named = [line for line in world.disagreements({r.rank: "ok" for r in world._ranks}) if "never received" in line]
        found += "".join(f"\n  {line}" for line in named)
        raise RanksCrashed(
            RankFailure(
                f"{what} found messages the implementation sent and nobody received (tag 0): {found}. "
                "Each would be taken by a later test's receive; this world is rebuilt for the next test.",
                [RankReport(r.rank, "ok", "", "") for r in world._ranks],
            )
        )
