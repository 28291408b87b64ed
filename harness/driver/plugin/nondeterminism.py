"""A failure that did not repeat when Hypothesis replayed its example (Hypothesis's ``Flaky``
errors) reported as what it is: nondeterminism in the code under test, with both outcomes and the
command that replays the example, instead of Hypothesis's nested ``FlakyFailure`` tracebacks.

The suite's inputs replay exactly (derandomized profiles, the delay schedule of --perturb-timing
drawn from the same example), so an outcome that changes between two runs of one example comes
from inside the ranks: a race between a thread or the backend and the program (a result read
before its communication completed, a buffer changed before its send left), or memory read before
it was written.
"""

from __future__ import annotations

from hypothesis.errors import Flaky, FlakyStrategyDefinition

FIRST_OUTCOME_CHARS = 3000  # of the first outcome's message: its head names the value or call that differed


def is_flaky(error: BaseException) -> bool:
    """Hypothesis's own 'unreliable results' (not a strategy that draws differently: the suite's bug)."""
    return isinstance(error, Flaky) and not isinstance(error, FlakyStrategyDefinition)


def nondeterminism_report(error: BaseException, item) -> str:
    firsts = [e for e in getattr(error, "exceptions", ()) if isinstance(e, BaseException)]
    first = "\n".join(f"{type(e).__name__}: {e}" for e in firsts) or str(error)
    if len(first) > FIRST_OUTCOME_CHARS:
        first = first[:FIRST_OUTCOME_CHARS] + f"\n[... {len(first) - FIRST_OUTCOME_CHARS} characters left out ...]"
    replay = str(error).strip().splitlines()[0] if str(error).strip() else "it did not fail again"
    target = getattr(item, "funcargs", {}).get("target")
    command = target.reproduce(item.nodeid) if target is not None else f"pytest {item.nodeid}"
    return (
        f"nondeterminism: this example failed once and did not fail the same way when it was replayed with the "
        f"same inputs (and the same --perturb-timing schedule): a race in the code under test (a result read "
        f"before its communication completed, a buffer changed before its send left, threads racing) or memory "
        f"read before it was written.\n"
        f"  first outcome: {first}\n"
        f"  replayed: {replay}\n"
        f"  reproduce (it may pass; run it a few times): {command}"
    )
