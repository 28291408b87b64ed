"""What the driver does when the project's own adapters say torch's library cannot run an example
(harness.driver.plugin.refusals.Refusals): reject it, skip a test none of whose examples ran, stop a
test that ran some at the budget, and never end a test by a skip or a stop once an example failed
(Hypothesis then shrinks the failure, and refusals on the way must not hide it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis.errors import StopTest, UnsatisfiedAssumption

from parallelism_conformance.harness.driver.plugin import refusals as refusals_module
from parallelism_conformance.harness.driver.plugin.refusals import EnoughRefused, Refusals

REASON = "torch.distributed.pipelining cannot run a schedule whose last stage runs its forwards out of order (1 0)"


@pytest.fixture
def in_hypothesis(monkeypatch):
    monkeypatch.setattr(refusals_module, "currently_in_test_context", lambda: True)


def refuse(refusals: Refusals) -> type:
    """The exception refusing one fresh example raises."""
    with pytest.raises((UnsatisfiedAssumption, pytest.skip.Exception)) as raised:
        refusals.refuse(REASON, object())
    return raised.type


def test_a_test_none_of_whose_examples_ran_is_skipped_after_ten(in_hypothesis):
    refusals = Refusals()
    assert [refuse(refusals) for _ in range(9)] == [UnsatisfiedAssumption] * 9
    with pytest.raises(pytest.skip.Exception, match=r"no drawn example ran: 10x .*out of order \(1 0\)"):
        refusals.refuse(REASON, object())


def test_a_test_that_ran_examples_stops_at_the_budget_and_its_note_says_so(in_hypothesis):
    refusals = Refusals()
    refusals.ran_task(object())
    refused_after_running = object()
    refusals.ran_task(refused_after_running)  # generated its schedule, then its step was refused
    assert refuse(refusals) is UnsatisfiedAssumption
    with pytest.raises(UnsatisfiedAssumption):
        refusals.refuse(REASON, refused_after_running)
    assert refusals.ran() == 1
    assert [refuse(refusals) for _ in range(Refusals.REFUSAL_BUDGET - 3)] == [UnsatisfiedAssumption] * 47
    assert refuse(refusals) is EnoughRefused
    assert refusals.note().startswith(
        "1 examples ran; 50 drawn examples the library under test cannot run were not, and drawing stopped there, as: 50x "
    )


def test_once_an_example_failed_refusals_only_reject(in_hypothesis):
    refusals = Refusals()
    inner = SimpleNamespace(calls=0)

    def failing_example():
        inner.calls += 1
        raise AssertionError("rank 0 output: element [0] expected 1.0, got 2.0")

    test = SimpleNamespace(hypothesis=SimpleNamespace(inner_test=failing_example))
    refusals.watch_failures(test)
    refusals.watch_failures(test)  # once per test function
    with pytest.raises(AssertionError):
        test.hypothesis.inner_test()
    assert refusals.failed and inner.calls == 1
    assert {refuse(refusals) for _ in range(2 * Refusals.REFUSAL_BUDGET)} == {UnsatisfiedAssumption}


def test_a_rejection_a_skip_or_hypothesis_s_own_flow_is_not_a_failure(in_hypothesis):
    """Hypothesis ends examples by StopTest (a BaseException) too: once counted as a failure here,
    an adapter's context-parallel tests drew 459 examples and ended Unsatisfiable."""
    refusals = Refusals()
    for raised in (UnsatisfiedAssumption(), pytest.skip.Exception("skipped"), StopTest(0)):

        def example(raised=raised):
            raise raised

        test = SimpleNamespace(hypothesis=SimpleNamespace(inner_test=example))
        refusals.watch_failures(test)
        with pytest.raises(type(raised)):
            test.hypothesis.inner_test()
    assert not refusals.failed


def test_outside_hypothesis_a_refusal_skips_with_the_reason():
    with pytest.raises(pytest.skip.Exception, match=r"out of order \(1 0\)"):
        Refusals().refuse(REASON, object())


def test_a_probe_that_does_not_finish_is_an_error_naming_it_never_a_base_exception():
    """The probe of the backend's own collectives (conformance/conftest.py) runs in a session
    fixture: a task failure there is one of the harness's BaseExceptions, which pytest does not
    cache as a fixture's error (every later test then errored with a bare AssertionError from
    inside pytest, on a loaded CI machine). It must come out as an Exception that names the probe,
    and with a deadline of its own, not the implementation's --rank-timeout."""
    from parallelism_conformance.conformance.conftest import PROBE_TIMEOUT_S, probe_refusals
    from parallelism_conformance.harness.driver.failures import RankFailure, RanksHung

    asked = []

    class HangingPool:
        timeout_s = 2.0

        def close_world(self, n):  # the probe's world is a fresh one (issue 45, class 1)
            asked.append(("closed", n))

        def run(self, n, program, args, impl, timeout_s):
            asked.append(timeout_s)
            raise RanksHung(RankFailure("no result within the deadline"))

    plan = SimpleNamespace(backends=lambda: ["gloo"], sizes=lambda backend: [1, 2, 4])
    with pytest.raises(RuntimeError, match="the probe of gloo's own collectives on 2 ranks") as raised:
        probe_refusals(HangingPool(), plan)
    assert isinstance(raised.value, Exception) and asked == [("closed", 2), PROBE_TIMEOUT_S]


def _refusal_texts():
    """Every ``raise NotImplementedError(...)`` in adapters/, as (where, the text or the constant's
    value): a literal or f-string read as written, a name or ``module.NAME`` looked up in the adapter's
    own module or its refusals module (read with ast: a library's adapter is not importable here)."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "adapters"
    constants: dict[str, str] = {}
    trees = {path: ast.parse(path.read_text()) for path in sorted(folder.glob("*.py"))}
    for path, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                if isinstance(value, str):
                    constants.update({f"{path.stem}.{t.id}": value for t in node.targets})
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and getattr(node.exc.func, "id", "") == "NotImplementedError"
            ):
                continue
            argument = node.exc.args[0] if node.exc.args else None
            where = f"{path.name}:{node.lineno}"
            if isinstance(argument, ast.Name):
                yield where, constants.get(f"{path.stem}.{argument.id}", "")
            elif isinstance(argument, ast.Attribute) and isinstance(argument.value, ast.Name):
                yield where, constants.get(f"{_imported_as(tree).get(argument.value.id, argument.value.id)}.{argument.attr}", "")
            elif isinstance(argument, ast.Call):
                yield where, None  # a function builds it: its own test checks the words
            else:
                yield where, ast.unparse(argument) if argument is not None else ""


def _imported_as(tree) -> dict[str, str]:
    """The names a module gives the modules it imports (``from ... import megatron_core_refusals as
    refusals``: refusals -> megatron_core_refusals), by their last dotted part."""
    import ast

    names = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({alias.asname or alias.name: alias.name.rsplit(".", 1)[-1] for alias in node.names})
    return names


def test_every_adapter_refusal_says_cannot():
    """A library adapter's NotImplementedError is a refusal (the example is rejected, the library is
    not failed) only when its last line says "cannot" (conformance/verdict.py, adapter_cannot); one
    that does not would score a library "not implemented" for what it cannot run."""
    texts = list(_refusal_texts())
    assert len(texts) > 20, texts  # the walk found the adapters' refusals
    silent = [(where, text) for where, text in texts if text is not None and "cannot" not in text]
    assert not silent, f"refusals without 'cannot' (they would read as not implemented): {silent}"
