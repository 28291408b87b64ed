"""Imported by the forkserver (harness/rank/preload.py), never by the driver: the order in which the
kernel's OOM killer takes the processes of a grading container. It picks the largest badness, the
resident set plus oom_score_adj thousandths of the memory (mm/oom_kill.c, oom_badness): ranks set
1000 for themselves (harness/rank/loop.py), this makes the forkserver 500, and every rank it forks is
born at 500 until it raises itself, so a container that runs out of memory loses a rank, then the
forkserver (its ranks die with it and the driver starts another), and never the driver at 0, which
writes the report. Without it, at 768 MiB the driver (the largest process at 0) was killed while a
world was starting (issue 60). Raising one's own score needs no privilege."""

FORKSERVER_OOM_SCORE_ADJ = 500

try:
    with open("/proc/self/oom_score_adj", "w") as _adjust:
        _adjust.write(str(FORKSERVER_OOM_SCORE_ADJ))
except OSError:  # no procfs (not Linux)
    pass
