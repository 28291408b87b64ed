"""A test's declared strata run first, whatever the seed and whatever the speed
(harness/driver/plugin/strata.py): forced picks by label, the rest drawn the same way on every run;
a failure names its stratum; an implementation too slow to cover them in its share of a time budget
fails the test on time, naming the strata not covered, and a fast one is unaffected."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallelism_conformance.harness.driver.plugin.strata import StratumData, name, run_strata


def test_a_stratum_forces_its_labels_and_draws_the_rest_the_same_way_every_time():
    first = StratumData({"src": 3}, seed=11)
    again = StratumData({"src": 3}, seed=11)
    assert first.draw(st.integers(0, 7), label="src") == 3
    drawn = [first.draw(st.integers(0, 2**30), label="seed") for _ in range(4)]
    assert drawn == [again.draw(st.integers(0, 2**30), label="seed") for _ in range(4)]
    assert name({"layout": "world_size=4 (group [1, 2, 3])", "dtype": "torch.bfloat16", "dst": 3}) == (
        "world_size=4 (group [1, 2, 3]), dtype=bfloat16, dst=3"
    )


def _item(test, **funcargs):
    return SimpleNamespace(obj=test, funcargs=funcargs, _fixtureinfo=SimpleNamespace(argnames=tuple(funcargs)), nodeid="t::test")


class Share:
    def __init__(self, seconds: float):
        self.share_s, self.until = seconds, time.monotonic() + seconds


def test_a_failing_stratum_fails_the_test_named():
    @given(data=st.data())
    def wrong_on_bfloat16(data, seen):
        seen.append(data.draw(st.sampled_from(["float32", "bfloat16"]), label="dtype"))
        assert seen[-1] != "bfloat16", "wrong on bfloat16"

    seen = []
    with pytest.raises(AssertionError, match="wrong on bfloat16") as failure:
        run_strata(_item(wrong_on_bfloat16, seen=seen), [{"dtype": "float32"}, {"dtype": "bfloat16"}], None)
    assert seen == ["float32", "bfloat16"]
    assert "stratum 2 of 2: dtype=bfloat16" in "\n".join(failure.value.__notes__)


def test_too_slow_to_cover_its_strata_in_its_share_fails_on_time_naming_them():
    @given(data=st.data())
    def slow(data, pause_s):
        data.draw(st.sampled_from(["float32", "float64", "bfloat16"]), label="dtype")
        time.sleep(pause_s)

    strata = [{"dtype": d} for d in ("float32", "float64", "bfloat16")]
    with pytest.raises(pytest.fail.Exception) as failure:
        run_strata(_item(slow, pause_s=0.3), strata, Share(0.4))
    assert str(failure.value) == (
        "too slow to cover its strata: covered 2 of 3 strata in its 0.4 s share of the time budget; not covered: dtype=bfloat16"
    )
    assert run_strata(_item(slow, pause_s=0.0), strata, Share(5.0)) == []  # fast: every stratum, no failure


@pytest.fixture
def broadcast_under_budget(suite_runner, tmp_path):
    def run(impl: str, budget_s: float):
        result = suite_runner.run(
            "conformance/test_collectives.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "--impl",
            impl,
            "--hypothesis-profile=grading",
            "--contain-ranks",
            "no",
            "--time-budget",
            str(budget_s),
            "--report-dir",
            str(tmp_path),
            "-k",
            "test_broadcast",
        )
        tests = json.loads((tmp_path / "results.json").read_text())["tests"]
        return result, {t["name"]: t for t in tests}

    return run


# the slow implementation's test is tests/test_autograder_attacks.py's class 9: graded in the emulated container


def test_a_fast_implementation_covers_its_strata_and_passes(broadcast_under_budget):
    result, tests = broadcast_under_budget("torch.distributed", 60)
    assert result.returncode == 0, result.stdout[-3000:]
    assert tests["test_broadcast"]["status"] == "passed", tests
