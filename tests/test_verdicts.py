"""The three verdicts kept apart (issue 56): *wrong* (a value, a semantic or a rule of the contract)
always fails and is named first; *costs more* (bytes above the theory's bound) fails only where
bounds are required and is otherwise a pass with its ratio; *differs by design* (a library's
documented behaviour, declared with its source, reproduced whole by the reference run with it).
Each its own verdict in the scorecard, the JUnit XML and results.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallelism_conformance.conformance import by_design
from parallelism_conformance.conformance.audit.common import Audited, check
from parallelism_conformance.conformance.verdict import Judge
from parallelism_conformance.harness.driver import audit
from parallelism_conformance.harness.driver.plugin.state import Designs

FIXTURES = Path(__file__).parent / "fixtures"
RECORDS = {
    0: [
        {"op": "send", "bytes": 300, "peer": 1},
        {"op": "allreduce", "group": [0, 1], "numel": 4, "itemsize": 4, "bytes": 16, "out_bytes": 16, "root": None, "dtype": "float32"},
    ]
}


def judged(require_bounds: bool) -> tuple[Judge, list]:
    judge = Judge("world_size=2", "parallelism-conformance ...")
    judge.audited = Audited(None, None, True, None, None, require_bounds=require_bounds)
    return judge, judge.audited.costs


def test_bytes_above_the_bound_are_a_cost_a_collective_where_p2p_is_required_is_wrong():
    costs = audit.within_bound(RECORDS, {0: 100}, "a step")
    wrong = audit.point_to_point_only(RECORDS)
    assert costs and all(isinstance(v, audit.Cost) for v in costs) and "(3.16x)" in costs[0]
    assert wrong and not any(isinstance(v, audit.Cost) for v in wrong)


def test_a_cost_is_reported_beside_a_pass_unless_bounds_are_required():
    judge, costs = judged(require_bounds=False)
    check(judge, audit.within_bound(RECORDS, {0: 100}, "a step"))  # no failure
    assert len(costs) == 1 and costs[0].startswith("costs more (world_size=2): rank 0: sent 316 B")
    judge, _ = judged(require_bounds=True)
    with pytest.raises(AssertionError, match=r"costs more than the theory's bound \(--require-bounds\)"):
        check(judge, audit.within_bound(RECORDS, {0: 100}, "a step"))


def test_a_cost_never_hides_a_wrong_finding_in_the_same_test():
    judge, costs = judged(require_bounds=False)
    with pytest.raises(AssertionError) as failed:
        check(judge, [*audit.within_bound(RECORDS, {0: 100}, "a step"), *audit.point_to_point_only(RECORDS)])
    message = str(failed.value)
    assert message.index("backend collective call") < message.index("and it costs more than the theory's bound")
    assert costs == []  # a failed test is wrong, not "costs more"


def test_right_values_and_more_bytes_read_costs_more_never_fail_unless_asked(suite_runner, tmp_path):
    impl = str(FIXTURES / "costly_all_reduce_impl.py")
    common = ("conformance/audit/test_collectives.py", "-q", "-p", "no:cacheprovider", "--impl", impl, "--capability", "all_reduce,audit")
    chosen = ("-k", "largest_world and all_reduce")
    lenient = suite_runner.run(*common, *chosen, "--require-bounds", "no", "--report-dir", str(tmp_path / "no"))
    assert lenient.returncode == 0, lenient.stdout[-3000:]
    assert "audit       1       0        0  costs more" in lenient.stdout, lenient.stdout[-2000:]
    results = json.loads((tmp_path / "no" / "results.json").read_text())
    assert results["extra_data"]["costs_more"] == ["test_bytes_sent_within_bound_at_the_largest_world[all_reduce]"]
    assert "(2.00x)" in results["tests"][0]["output"] and "costs more" in results["tests"][0]["tags"]
    assert '<property name="verdict" value="costs more"' in (tmp_path / "no" / "junit.xml").read_text()
    # under --require-bounds yes the same finding fails: test_a_cost_is_reported_beside_a_pass_unless_bounds_are_required


def _fails(message: str):
    def judge():
        raise AssertionError(message)

    return judge


def test_a_declared_design_explains_only_a_difference_its_reference_reproduces_whole():
    designs = Designs({"unused_parameters_get_zero_grad": ("unused parameters get a zero gradient", "engine.py")})
    variants = {"unused_parameters_get_zero_grad": lambda: None}  # the design's reference holds on every check
    by_design.judged(designs, _fails("rank 0 'aux.weight' after step 2: expected 1.0, got 0.9"), variants)
    by_design.judged(designs, _fails("rank 0 'aux.weight' after step 2: expected 1.0, got 0.9"), variants)  # a second example
    assert designs.findings == [
        "differs by design: unused parameters get a zero gradient (source: engine.py); the contract's check: "
        "rank 0 'aux.weight' after step 2: expected 1.0, got 0.9"
    ]
    with pytest.raises(AssertionError, match="'w' after step 1"):  # the design's reference fails too: the contract's failure
        by_design.judged(designs, _fails("'w' after step 1"), {"unused_parameters_get_zero_grad": _fails("'w' differs there too")})
    undeclared = Designs()  # a student's implementation, or any run under the grading profile, declares none
    with pytest.raises(AssertionError, match="aux.weight"):
        by_design.judged(undeclared, _fails("aux.weight"), variants)
    by_design.judged(undeclared, lambda: None, variants)  # the contract's judgement passing is a pass
    assert undeclared.findings == []
