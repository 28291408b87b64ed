"""What the driver concludes from what its relay carried in a task (harness/driver/relay.py): the
stray messages and ended connections that fail it, and whether the kernel's count of what each rank
wrote is explained by what the relay read from it."""

from __future__ import annotations

from parallelism_conformance.harness.driver.relay import Relayed


def check_strays(world, program: str, relayed: Relayed) -> None:
    """After a task every rank finished: messages sent and never received, or a connection the relay
    ended, fail it (as the stray-message check does on gloo, harness/driver/stray_messages.py); the
    world is rebuilt for the next test."""
    __tracebackhide__ = True
    from parallelism_conformance.harness.driver.failures import RankFailure, RankReport, RanksCrashed

    if not relayed.strays and not relayed.broken:
        return
    world.close()
    found = []
    if relayed.strays:
        found.append(f"messages the implementation sent and nobody received: {'; '.join(relayed.strays)}")
    found.extend(relayed.broken)
    raise RanksCrashed(
        RankFailure(
            f"{program} on {world.size} ranks finished, but the relay found {'; and '.join(found)}. "
            "Each would be taken by a later test's receive; this world is rebuilt for the next test.",
            [RankReport(rank, "ok", "", "") for rank in range(world.size)],
        )
    )


def accounted(relayed: Relayed, written_by_rank: dict[int, int | None], allowance: int) -> list[str]:
    """Every byte the kernel saw a rank write during the task (harness/driver/io_counters.py: its
    writes, and what it sent on the store's socket) reached the relay, up to ``allowance`` (the
    audit's fixed slack, harness/driver/audit.py: FIXED). Both counts are read where no rank reaches;
    more written than relayed went around the transport (a private gloo group, the store, a file)."""
    violations = []
    for rank, written in sorted(written_by_rank.items()):
        if written is None:
            continue
        extra = written - relayed.read[rank] - allowance
        if extra > 0:
            violations.append(
                f"rank {rank}: the kernel counted {written} B written during the task, {extra} B more than "
                f"the {relayed.read[rank]} B the driver's relay read from it (with {allowance} B of slack): "
                "communication that went around the relay"
            )
    return violations
