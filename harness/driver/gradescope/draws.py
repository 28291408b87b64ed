"""What the grading profile draws, printed one example a line: run by two interpreters (the
autograder's, installed by setup.sh from the lock, and a student's checkout under the same lock), the
two outputs are equal exactly when a derandomized run draws the same examples in both, which is what
makes the grade a student reproduces the grade they got (tests/test_autograder.py).

Hypothesis derives a derandomized run's seed from the test function (its source and name), so the
functions here stand for the suite's: same code, same Hypothesis and Python behaviour, same draws.

    python -m parallelism_conformance.harness.driver.gradescope.draws [N]
"""

from __future__ import annotations

import sys

from hypothesis import HealthCheck, Phase, given, settings

from parallelism_conformance.conformance import examples

DRAWN = 25


def draws(n: int = DRAWN) -> list[str]:
    seen: list[str] = []
    # the grading profile's drawing settings (harness/driver/plugin/profiles.py), generation only
    grading = settings(
        max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)
    )

    @grading
    @given(layout=examples.layouts(4), training=examples.training_examples(4))
    def drawn(layout, training):
        seen.append(f"{layout} | {training}")

    drawn()
    return seen


if __name__ == "__main__":
    print("\n".join(draws(int(sys.argv[1]) if len(sys.argv) > 1 else DRAWN)))
