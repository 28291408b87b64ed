"""The Hypothesis profiles of the suite, registered when the plugin loads (before Hypothesis's
pytest plugin reads --hypothesis-profile), and the one that is current."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

# filter_too_much: an example the project's own adapters say torch cannot run is rejected
# (conformance.verdict.run_or_skip); for torch's runtime that is most random pipeline orders
_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
PROFILES = {
    "quick": dict(max_examples=15),
    "ci": dict(max_examples=25, derandomize=True, print_blob=True),
    "thorough": dict(max_examples=150, print_blob=True),
    "grading": dict(max_examples=50, derandomize=True, print_blob=True),
    # For harness.driver.mutation: like ci, but a mutant is killed by its first failure; no time spent shrinking.
    "mutation": dict(max_examples=25, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate]),
    # For harness.driver.mutation's correct implementations under outsiders/: a whole conformance file each.
    "brief": dict(max_examples=10, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate]),
    # For harness.driver.mutation's run of torch's own implementations over every capability: a second
    # opinion on the judges (a known-good implementation the suite did not write must pass), where the
    # mutants' kills rest on the bundled implementation passing their own draws (the ci profile's)
    "second_opinion": dict(max_examples=5, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate]),
    # For tests/test_libraries.py: one drawn example of one test, that a library's adapter runs in its venv
    "smoke": dict(max_examples=1, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate]),
}
# Each derandomized profile's random twin ("mutation_random"): the same settings, the examples drawn
# from --hypothesis-seed (the mutation runner's --seeds: a kill must not rest on one lucky draw)
PROFILES.update({f"{name}_random": {**options, "derandomize": False} for name, options in list(PROFILES.items()) if options.get("derandomize")})
for _name, _options in PROFILES.items():
    settings.register_profile(_name, **_options, **_COMMON)
settings.load_profile("quick")  # without --hypothesis-profile


def current_profile() -> str:
    """The name of the profile in force (--hypothesis-profile, else quick)."""
    return settings.get_current_profile_name()
