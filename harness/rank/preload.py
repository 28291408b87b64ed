"""What every rank has imported before the implementation loads: the forkserver imports these once
and forks each rank from it (harness/driver/world.py), and the autograder's import check imports
them before the submission, so that what it measures is what the submission adds to a rank."""

# torch._dynamo: torch imports it lazily on the first call of a function it decorated, such as the
# first optimizer's constructor, and that import cost each rank about 0.9 s of CPU in its first
# training task (1.4 s under load): 9 s of a 12 s data-parallel mutant run with worlds of 1-4.
# Loaded once in the forkserver, every rank shares it.
# oom_order: the forkserver and the ranks it forks go to the OOM killer before the driver does
PRELOAD = (
    "parallelism_conformance.harness.rank.oom_order",
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "parallelism_conformance.harness.rank.loop",
    "parallelism_conformance.harness.rank.programs",
)


def with_library_modules(environment: dict) -> list[str]:
    """PRELOAD, then the modules CONFORMANCE_RANK_PRELOAD names (comma-separated): what scripts/libraries
    sets for a library whose import is slow (harness/driver/libraries/table.py, ``environment``), so
    that the forkserver imports it once, before any rank has a task's deadline to meet, and not each
    rank inside its first task (torchtitan: about 4 s alone, over a minute for one of 3 ranks on 2
    busy cores). A module that does not import is left to the rank, as multiprocessing's preload does."""
    extra = [name.strip() for name in environment.get("CONFORMANCE_RANK_PRELOAD", "").split(",") if name.strip()]
    return [*PRELOAD, *(name for name in extra if name not in PRELOAD)]
