"""harness/driver/mutation.py's own rules: a kill by a deadline alone is the runner's failure unless
the bug is a hang, a deadlock report is a kill, the runs start longest first, by the last run's
seconds where there was one and by their kind's estimate where not, and a buggy outsider's targets
narrow its run."""

from __future__ import annotations

import pytest

from parallelism_conformance.harness.driver.mutation import (
    ESTIMATE_S,
    Job,
    failing_line,
    longest_first,
    only_a_deadline,
    read_durations,
    second_opinion,
    write_durations,
)
from parallelism_conformance.harness.driver.mutation_catalog import Mutant, Outsider, folder_of, mutants, outsiders, rotated, rotation

DEADLINE_FAILURE = """\
    def test_all_reduce(...):
>       pool.run(...)
E       parallelism_conformance.harness.driver.failures.RanksHung: parallelism_conformance.harness.rank.programs.collectives:call on 2 ranks: no result within the 10 s deadline (rank 1 hung)
E       --- rank 0: ok
E
E       --- rank 1: hung
conformance/test_collectives.py:122: RanksHung
"""
DEADLOCK_FAILURE = """\
E       parallelism_conformance.harness.driver.failures.RanksDeadlocked: parallelism_conformance.harness.rank.programs.collectives:call on 2 ranks: deadlock: every rank is waiting (rank 0 in recv from 1; rank 1 in recv from 0) and no byte moved for 0.6 s (rank 0 hung, rank 1 hung)
"""
# the stray-message check's deadline, on a later line of the first failure's message
STRAY_CHECK_DEADLINE = """\
E       parallelism_conformance.harness.driver.failures.RanksCrashed: parallelism_conformance.harness.rank.programs.collectives:call on 2 ranks finished, but the stray-message check after it failed: a receive ...
E       parallelism_conformance.harness.rank.programs.probe:stray_messages on 2 ranks: no result within the 10 s deadline (rank 1 hung)
"""
# a value failure first; a later test's deadline (not under -x, but whatever follows) does not count
VALUE_THEN_DEADLINE = """\
E       AssertionError: rank 1 tensor: element [0] expected 2.0, got 1.0
E         example: world_size=2

E       parallelism_conformance.harness.driver.failures.RanksHung: ... no result within the 10 s deadline (rank 1 hung)
"""


def test_a_kill_by_a_deadline_alone_is_told_apart_from_evidence():
    assert only_a_deadline(DEADLINE_FAILURE)
    assert only_a_deadline(STRAY_CHECK_DEADLINE)
    assert not only_a_deadline(DEADLOCK_FAILURE)  # nothing moved: evidence, not load
    assert not only_a_deadline(VALUE_THEN_DEADLINE)
    assert failing_line(VALUE_THEN_DEADLINE) == "AssertionError: rank 1 tensor: element [0] expected 2.0, got 1.0"
    assert failing_line("1 passed") == "(no assertion line)"


def test_the_mutants_whose_bug_is_a_hang_say_so_and_no_other_does():
    hangs = {m.path.stem for m in mutants() if m.hang}
    assert hangs == {
        "disagree_circular_wait",
        "disagree_dtype",
        "disagree_peer",
        "disagree_size",
        "disagree_skipped_collective",
        "disagree_tag",
        "count_over_the_world",
    }


def test_bug_hang_is_read_from_the_docstring(tmp_path):
    folder = tmp_path / "collectives"
    folder.mkdir()
    (folder / "waits.py").write_text('"""Ranks wait.\ntargets: test_all_reduce\nbug: hang\n"""\n')
    (folder / "wrong.py").write_text('"""Wrong values; no bug: hang here.\ntargets: test_all_reduce\n"""\n')
    assert Mutant.read(folder / "waits.py").hang and not Mutant.read(folder / "wrong.py").hang


def test_a_buggy_outsiders_targets_narrow_its_run_and_a_correct_one_may_not_have_any(tmp_path):
    """A buggy outsider's 'targets:' is the -k of its run (the tests that catch it, for the runner's
    time); a correct one runs everything it claims, so a 'targets:' there is refused."""
    folder = tmp_path / "data_parallel"
    folder.mkdir()
    (folder / "bug.py").write_text('"""Buckets never reduced.\n\nverdict: fail\ncapability: data_parallel\ntargets: test_bucketed\n"""\n')
    (folder / "good.py").write_text('"""Correct: buckets.\n\nverdict: pass\ncapability: data_parallel\ntargets: test_bucketed\n"""\n')
    args = Outsider.read(folder / "bug.py").pytest_args()
    assert args[args.index("-k") + 1] == "test_bucketed" and "-x" in args
    with pytest.raises(ValueError, match="only a buggy outsider"):
        Outsider.read(folder / "good.py")


def job(key: str, kind: str) -> Job:
    return Job(key, kind, lambda: (0, "", 0.0))


def test_runs_start_longest_first_by_the_last_runs_seconds_else_by_kind():
    jobs = [
        job("known good: a", "known good"),
        job("known good: b", "known good"),
        job("outsider: c", "outsider"),
        job("mutant: d", "mutant"),
        job("mutant: e", "mutant"),
    ]
    assert [j.key for j in longest_first(jobs, {})] == [j.key for j in jobs]  # the estimates keep this order
    assert ESTIMATE_S["known good"] > ESTIMATE_S["outsider"] > ESTIMATE_S["mutant"]
    last = {"known good: a": 40.0, "known good: b": 300.0, "mutant: e": 60.0}  # c and d never timed
    assert [j.key for j in longest_first(jobs, last)] == ["known good: b", "mutant: e", "known good: a", "outsider: c", "mutant: d"]


def test_the_durations_file_round_trips_and_a_missing_or_broken_one_is_empty(tmp_path):
    path = tmp_path / "durations.json"
    assert read_durations(path) == {}
    write_durations(path, {"mutant: d": 8.04, "known good: a": 279.0})
    assert read_durations(path) == {"mutant: d": 8.0, "known good: a": 279.0}
    path.write_text("not json")
    assert read_durations(path) == {}
    path.write_text('["a list"]')
    assert read_durations(path) == {}


def test_the_rotation_runs_a_share_of_each_capability_the_same_for_one_seed_and_all_over_seeds():
    every_mutant, every_outsider = mutants(), outsiders()
    buggy = [o for o in every_outsider if o.verdict == "fail"]
    chosen, chosen_outsiders, said = rotated(every_mutant, every_outsider, 3, "c0ffee")
    assert {folder_of(m) for m in chosen} == {folder_of(m) for m in every_mutant}  # every capability, every commit
    chosen_buggy = [o for o in chosen_outsiders if o.verdict == "fail"]
    assert {folder_of(o) for o in chosen_buggy} == {folder_of(o) for o in buggy}
    assert all(o in chosen_outsiders for o in every_outsider if o.verdict == "pass")  # correct ones: all
    assert len(every_mutant) / 4 < len(chosen) < len(every_mutant) / 2, len(chosen)
    assert f"{len(chosen)} of {len(every_mutant)} mutants, {len(chosen_buggy)} of {len(buggy)} buggy outsiders" in said
    assert rotation(every_mutant, 3, "c0ffee") == chosen  # one commit: the same runs again
    for share, commits in ((3, 12), (4, 40)):  # the test command's share is 4
        seen = {m.path for seed in map(str, range(commits)) for m in rotation(every_mutant, share, seed)}
        assert seen == {m.path for m in every_mutant}, (share, len(seen))  # so many commits ran every mutant
    assert rotated(every_mutant, every_outsider, 1, "x") == (every_mutant, every_outsider, "")


def test_a_second_opinions_own_profile_gives_way_to_the_tiers_and_a_run_without_one_keeps_none():
    assert second_opinion(["conformance", "--hypothesis-profile=brief"], "smoke") == ["conformance", "--hypothesis-profile=smoke"]
    assert second_opinion(["conformance", "--hypothesis-profile=brief"], None) == ["conformance", "--hypothesis-profile=brief"]
    assert second_opinion(["conformance"], "smoke") == ["conformance"]  # it runs under --profile


def test_a_kill_at_some_seeds_only_is_weak_and_fails_the_run_naming_the_seeds_that_missed(capsys):
    from pathlib import Path

    from parallelism_conformance.harness.driver.mutation import at, seeded, seeds_of
    from parallelism_conformance.harness.driver.mutation_report import report_mutants

    lucky = Mutant(Path("mutants/collectives/lucky.py"), "caught by a lucky draw", "test_all_reduce", "conformance/test_collectives.py")
    steady = Mutant(Path("mutants/collectives/steady.py"), "caught every time", "test_all_reduce", "conformance/test_collectives.py")
    runs = {m.path.stem: [Job(f"mutant: collectives/{m.path.stem}{at(s)}", "mutant", None) for s in (11, 22, 33)] for m in (lucky, steady)}
    caught = (1, "E       AssertionError: rank 1 tensor: element [0] expected 2.0, got 1.0\n", 1.0)
    outcome = {"mutant: collectives/lucky (seed 22)": (0, "3 passed", 1.0)}
    killed, survived, deadline_only = report_mutants([lucky, steady], [runs["lucky"], runs["steady"]], lambda job: outcome.get(job.key, caught))
    printed = capsys.readouterr().out
    assert killed == ["collectives/steady"] and survived == ["collectives/lucky (2/3 seeds)"] and deadline_only == []
    assert "WEAK" in printed and "killed at 2/3 seeds; not at 22" in printed and "(at 3/3 seeds)" in printed
    assert seeded("mutation", None) == ["--hypothesis-profile=mutation"]
    assert seeded("mutation", 7) == ["--hypothesis-profile=mutation_random", "--hypothesis-seed=7"]
    assert seeds_of(0) == [None] and len(set(seeds_of(5))) == 5


def test_every_derandomized_profile_has_a_random_twin_for_the_seeded_runs():
    from hypothesis import settings

    from parallelism_conformance.harness.driver.plugin.profiles import PROFILES

    for name in ("mutation", "ci", "grading"):
        twin = settings.get_profile(f"{name}_random")
        assert not twin.derandomize and twin.max_examples == PROFILES[name]["max_examples"]


def test_a_mutant_that_does_not_load_is_not_killed_and_fails_the_run(capsys):
    """Every CS336 mutant once failed to import (its fixture's package read metadata that only the
    fixture's root declares) and the runner counted the import error as ten kills."""
    from pathlib import Path

    from parallelism_conformance.harness.driver.mutation_report import report_mutants

    broken = Mutant(Path("mutants/fully_sharded/broken.py"), "never loads", "test_x", "conformance/test_fully_sharded.py")
    unloadable = (
        1,
        "E       parallelism_conformance.harness.driver.failures.ImplementationUnloadable: the implementation under test cannot be loaded here\n",
        1.0,
    )
    killed, survived, _ = report_mutants([broken], [[Job("mutant: fully_sharded/broken", "mutant", None)]], lambda job: unloadable)
    assert killed == [] and survived == ["fully_sharded/broken"]
    assert "UNLOADED" in capsys.readouterr().out


def test_every_cs336_mutant_loads_its_fixture():
    """In one process (torch imported once): adapters.cs336 loaded again for each CS336 mutant."""
    import subprocess
    import sys

    from parallelism_conformance.harness.driver.libraries.venvs import ROOT

    paths = [str(m.impl_and_env()[1]["CS336_SUBMISSION"]) for m in mutants() if m.submission]
    script = (
        "import importlib, os, sys\n"
        "for path in sys.argv[1:]:\n"
        "    os.environ['CS336_SUBMISSION'] = path\n"
        "    module = sys.modules.get('parallelism_conformance.adapters.cs336')\n"
        "    importlib.reload(module) if module else importlib.import_module('parallelism_conformance.adapters.cs336')\n"
        "    print('loaded', path)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, *paths], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.count("loaded") == len(paths) >= 10, done.stdout[-1000:] + done.stderr[-2000:]
