"""Each test's strata, run as its first examples whatever the seed and whatever the speed (issue 58,
item 4; issue 59, item 2).

A test's strata are the classes a bug hides in (every dtype it can draw, a root other than 0, a
group that does not start at rank 0, uneven and smaller-than-the-world sizes, float values whose sum
depends on the order of addition): a drawn example reaches one only by luck, and a derandomized
profile's luck changes with every edit of the test's source. A conformance module declares them in
its ``STRATA``: {test function's name: callable(fixtures, params) -> [stratum]}, a stratum being a
dict of forced picks by label ("layout", "src", "dtype", ...). Here, before Hypothesis draws, each
stratum runs as one example of the test's own body: ``data`` is a StratumData, which returns a
forced pick for its label and draws the rest from a source seeded by the test and the stratum (the
test's own strategies, inside a Hypothesis build context). The strata run outside Hypothesis, so no
forced choice is ever replayed or shrunk by it (a counter forcing Hypothesis's first examples would
read to it as a strategy that draws differently on the same data: Flaky).

A stratum that fails fails the test, named. Under a time budget, a test whose strata end past its
share (plugin/time_share.py) fails on time, naming the strata not covered: an implementation too
slow to cover them is never passed on fewer examples (issue 58: speed bought a derandomized run
whose bug was first drawn after the floor). A fast implementation then draws for its share as before.
"""

from __future__ import annotations

import math
import time
import zlib
from random import Random

import pytest
from hypothesis.control import BuildContext
from hypothesis.errors import StopTest, UnsatisfiedAssumption
from hypothesis.internal.conjecture.data import ConjectureData

from parallelism_conformance.harness.driver.failures import BudgetExhausted
from parallelism_conformance.harness.driver.plugin.state import STATE

TRIES = 3  # seeds tried for the drawn rest of a stratum that a strategy's filter or assume rejected


class StratumData:
    """Hypothesis's ``data`` for a stratum's example: ``draw(strategy, label)`` returns the forced
    pick of ``label`` where the stratum has one, else draws from a ConjectureData seeded by ``seed``
    (deterministic: the same rest on every run, whatever --hypothesis-seed). ``stratum`` is read by
    the conformance side's drawers for picks that are not labels of a draw (a dtype among those allowed)."""

    def __init__(self, stratum: dict, seed: int):
        self.stratum = stratum
        self.conjecture = ConjectureData(random=Random(seed))

    def draw(self, strategy, label=None):
        if label is not None and label in self.stratum:
            return self.stratum[label]
        return self.conjecture.draw(strategy)


def shown(value) -> str:
    text = str(value)
    return text.removeprefix("torch.")


def name(stratum: dict) -> str:
    """``dtype=bfloat16, world_size=4 (group [1, 2, 3]), dst=3``: its picks, a layout by itself."""
    return ", ".join(shown(v) if k == "layout" else f"{k}={shown(v)}" for k, v in stratum.items())


def declared(item) -> list[dict]:
    """The test's strata from its module's STRATA (none: the test only draws)."""
    table = getattr(getattr(item, "module", None), "STRATA", None)
    build = table.get(getattr(item, "originalname", item.name)) if isinstance(table, dict) else None
    if build is None:
        return []
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return list(build(item.funcargs, params))


def body_of(test):
    """The test's own function under @given (Hypothesis's documented ``inner_test``), unwrapped from
    refusals.watch_failures: a stratum is not one of the examples the time share counts."""
    inner = test.hypothesis.inner_test
    return inner.__wrapped__ if getattr(inner, "_watched_by", None) is not None else inner


def run_one(body, arguments: dict, stratum: dict, seed: int) -> str:
    """Runs the stratum's example; returns "" when it ran, else why it did not apply (a skip the
    test's body raised for it, or rest drawn that its strategies rejected at every seed tried)."""
    for attempt in range(TRIES):
        data = StratumData(stratum, seed + attempt)
        try:
            with BuildContext(data.conjecture, wrapped_test=body):
                body(data=data, **arguments)
            return ""
        except (UnsatisfiedAssumption, StopTest):
            continue
        except pytest.skip.Exception as skipped:
            return str(skipped.msg)
    return f"its drawn rest was rejected at {TRIES} seeds"


def run_strata(item, strata: list[dict], share) -> list[str]:
    """Every stratum in order; a failure re-raised with the stratum named; past the share with
    strata left, the test fails on time. Returns a note per stratum that did not apply."""
    body = body_of(item.obj)
    arguments = {arg: item.funcargs[arg] for arg in item._fixtureinfo.argnames}
    notes = []
    for index, stratum in enumerate(strata):
        seed = zlib.crc32(f"{item.nodeid}|{name(stratum)}".encode())
        try:
            why = run_one(body, arguments, stratum, seed)
        except BudgetExhausted:
            # the run's whole budget ran out inside a stratum: the test is as short of its strata as
            # when its own share ran out between two (a load that slows the session's start gets here)
            pytest.fail(
                f"too slow to cover its strata: covered {index} of {len(strata)} strata before the run's time budget ran "
                f"out; not covered: {'; '.join(map(name, strata[index:]))}",
                pytrace=False,
            )
        except BaseException as failure:
            if not isinstance(failure, (KeyboardInterrupt, SystemExit)):
                failure.add_note(f"  stratum {index + 1} of {len(strata)}: {name(stratum)} (run first, whatever the seed)")
            raise
        if why:
            notes.append(f"stratum {name(stratum)} does not apply here: {why}")
        left = strata[index + 1 :]
        if left and share is not None and not math.isinf(share.share_s) and time.monotonic() > share.until:
            pytest.fail(
                f"too slow to cover its strata: covered {index + 1} of {len(strata)} strata in its {share.share_s:.1f} s "
                f"share of the time budget; not covered: {'; '.join(map(name, left))}",
                pytrace=False,
            )
    return notes


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Before pytest's own call (Hypothesis's draws), the test's strata; returns None so that it runs."""
    if getattr(pyfuncitem.obj, "hypothesis", None) is None:
        return None
    strata = declared(pyfuncitem)
    if not strata:
        return None
    state = pyfuncitem.config.stash.get(STATE, None)
    for note in run_strata(pyfuncitem, strata, state.share if state is not None else None):
        pyfuncitem.user_properties.append(("note", note))
    return None
