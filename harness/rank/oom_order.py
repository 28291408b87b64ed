"""Imported by the forkserver (harness/rank/preload.py), never by the driver: the order in which the
kernel's OOM killer takes the processes of a grading container. It picks the largest badness, the
resident set plus oom_score_adj thousandths of the memory (mm/oom_kill.c, oom_badness): ranks set
1000 for themselves (harness/rank/loop.py) and this sets the forkserver to 1000 too, so every rank
it forks is born there. At 1000 a process's badness passes the whole limit, more than the driver's
resident set at 0 can reach: a container that runs out of memory loses the largest of its ranks and
the forkserver (the forkserver's ranks die with it, and the driver starts another), never the
driver, which writes the report. With the forkserver at 0, at 768 MiB the driver was killed (issue
60); at 500 it was killed in one of two runs (500 adds only half the limit to the forkserver's
badness, which a driver of torch and pytest can pass). Raising one's own score needs no privilege."""

FORKSERVER_OOM_SCORE_ADJ = 1000

try:
    with open("/proc/self/oom_score_adj", "w") as _adjust:
        _adjust.write(str(FORKSERVER_OOM_SCORE_ADJ))
except OSError:  # no procfs (not Linux)
    pass
