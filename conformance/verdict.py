"""Judging in the driver: compare what ranks returned with the reference, and say exactly where
and how they differ (example, rank, element, expected against actual, and a command to rerun)."""

from __future__ import annotations

from pathlib import Path

import torch

from parallelism_conformance.conformance.examples import Layout, is_sentinel
from parallelism_conformance.harness.driver.failures import TASK_FAILURES, ImplementationIncomplete
from parallelism_conformance.harness.driver.perturbation import ReadBeforeCompletion
from parallelism_conformance.reference.tolerance import first_mismatch


class Judge:
    def __init__(self, example: str, reproduce: str):
        self.example = example
        self.reproduce = reproduce
        self.audited = None  # the audit's runner, once it ran this example (conformance/audit/common.py)

    def run(self, ranks, layout, program: str, per_member: list[dict]) -> dict:
        """Run a rank program on the layout's members; a failure on the ranks (raise, crash, hang)
        comes back annotated with this example and the command that reproduces it."""
        __tracebackhide__ = True
        self._ranks = ranks
        try:
            return ranks.run(layout.world_size, layout.members, program, per_member)
        except (*TASK_FAILURES, ReadBeforeCompletion) as failure:
            failure.add_note(f"  example: {self.example}\n  reproduce: {self.reproduce}")
            raise

    def call(self, ranks, layout, function: str, per_member: list[dict]) -> dict:
        """``impl.<function>(**arguments)`` on every member, through the generic rank program."""
        __tracebackhide__ = True
        return self.run(ranks, layout, "collectives:call", [{"function": function, "arguments": arguments} for arguments in per_member])

    def fail(self, problem: str):
        ranks = getattr(self, "_ranks", None)
        told = ranks.disagreements() if ranks is not None and hasattr(ranks, "disagreements") else []
        also = "".join(f"\n  the ranks disagree: {line}" for line in told)
        also += ranks.late_note() if ranks is not None and hasattr(ranks, "late_note") else ""
        raise AssertionError(f"{problem}{also}\n  example: {self.example}\n  reproduce: {self.reproduce}")

    def tensor(self, actual, expected: torch.Tensor, *, what: str, atol: torch.Tensor | None = None, suspects=None) -> None:
        """``actual`` must equal ``expected`` within ``atol`` (None: exactly). ``suspects``, a
        callable returning known wrong answers (reference/likely_bugs.py), is consulted only on a
        mismatch, to name the bug the wrong output points to."""
        if not isinstance(actual, torch.Tensor):
            self.fail(f"{what}: expected a tensor, got {type(actual).__name__}")
        if tuple(actual.shape) != tuple(expected.shape) or actual.dtype != expected.dtype:
            self.fail(f"{what}: expected shape {tuple(expected.shape)} {expected.dtype}, got shape {tuple(actual.shape)} {actual.dtype}")
        mismatch = first_mismatch(actual, expected, atol)
        if mismatch is None:
            return
        index, want, got = mismatch
        note = " (the output sentinel: this element was never written)" if is_sentinel(got, actual.dtype) else ""
        bound = ""
        if atol is not None and atol.numel():
            bound = f", allowed difference {float(atol.expand_as(expected)[index]):.3g}"
        differing = int((actual != expected).sum()) if atol is None else None
        count = f"; {differing} of {expected.numel()} elements differ" if differing else ""
        self.fail(f"{what}: element {list(index)} expected {want!r}, got {got!r}{note}{bound}{count}{_likely_bug(actual, atol, suspects)}")

    def tensors(self, actual, expected: list, *, what: str, atol=None) -> None:
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            length = len(actual) if isinstance(actual, (list, tuple)) else type(actual).__name__
            self.fail(f"{what}: expected a list of {len(expected)} tensors, got {length}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            self.tensor(a, e, what=f"{what}[{i}]", atol=atol)

    def bitwise_identical(self, per_rank: dict, *, what: str) -> None:
        """Every rank holds the same bits (a replicated result must not differ by rounding)."""
        items = list(per_rank.items())
        first_rank, first = items[0]
        for rank, tensor in items[1:]:
            if tensor.shape != first.shape or not torch.equal(_bits(tensor), _bits(first)):
                self.fail(f"{what}: rank {rank} and rank {first_rank} differ bitwise (a replicated result must be identical on every rank)")


def mismatch(actual, expected: torch.Tensor, atol=None) -> bool:
    """Whether ``actual`` (anything a rank returned) fails Judge.tensor's comparison."""
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape or actual.dtype != expected.dtype:
        return True
    return first_mismatch(actual, expected, atol) is not None


def _likely_bug(actual: torch.Tensor, atol, suspects) -> str:
    """'; it equals <a known wrong answer>', for the first suspect ``actual`` matches, else ''."""
    for description, wrong, wrong_atol in suspects() if suspects is not None else ():
        if (
            wrong.shape == actual.shape
            and wrong.dtype == actual.dtype
            and actual.numel()
            and first_mismatch(actual, wrong, wrong_atol if wrong_atol is not None else atol) is None
        ):
            return f"; it equals {description}"
    return ""


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def check_names(judge: Judge, actual, expected: dict, what: str, why: str = "") -> None:
    """``actual`` must be a dict with exactly the keys of ``expected``."""
    if not isinstance(actual, dict) or set(actual) != set(expected):
        got = sorted(actual) if isinstance(actual, dict) else type(actual).__name__
        missing = sorted(set(expected) - set(actual)) if isinstance(actual, dict) else sorted(expected)
        extra = sorted(set(actual) - set(expected)) if isinstance(actual, dict) else []
        judge.fail(f"{what}: expected {sorted(expected)}, got {got} (missing {missing}, unexpected {extra}){why}")


# the project's own adapters of torch's libraries, by module name, as --impl names them (a file
# named adapters.py, or any path, is not one of them). adapters.cs336 is not one: it runs a student's
# submission, so whatever it raises is the submission's and is graded.
SUBMISSION_ADAPTERS = frozenset({"parallelism_conformance.adapters.cs336"})
TRUSTED_ADAPTERS = (
    frozenset(
        f"parallelism_conformance.adapters.{path.stem}"
        for path in (Path(__file__).parent.parent / "adapters").glob("*.py")
        if path.stem != "__init__"
    )
    - SUBMISSION_ADAPTERS
)


def run_or_skip(judge: Judge, ranks, layout: Layout, program: str, per_member: list[dict]) -> dict:
    """judge.run. For the project's own adapters (--impl parallelism_conformance.adapters.*, a choice of the driver's
    options, never of the ranks) a NotImplementedError("... cannot ...") on every rank says what
    torch's library cannot do on this backend: the example (``judge``, one per example) is refused
    (``ranks.refusals``, harness.driver.plugin.refusals.Refusals: rejected and another drawn inside
    Hypothesis, the test skipped outside it). For any other implementation the same error is "not
    implemented": it scores 0."""
    return _refusable(ranks, judge, lambda: judge.run(ranks, layout, program, per_member))


def run_refusable(ranks, example, world_size: int, program: str, per_member: list[dict]) -> dict:
    """``ranks.run`` on the whole world, with run_or_skip's refusals; ``example`` (one object per
    drawn example) stands for it in the count of what ran and what was refused."""
    return _refusable(ranks, example, lambda: ranks.run(world_size, None, program, per_member))


def _refusable(ranks, example, run) -> dict:
    try:
        outputs = run()
    except ImplementationIncomplete as incomplete:
        reason = adapter_cannot(ranks.target.impl, incomplete)
        if not reason:
            raise
        ranks.refusals.refuse(reason, example)
    ranks.refusals.ran_task(example)
    return outputs


def adapter_cannot(impl: str, incomplete: ImplementationIncomplete) -> str | None:
    """What torch's library cannot do, when ``impl`` is one of the project's own adapters and every
    rank that did not return (a group's members; the others return) raised
    NotImplementedError("... cannot ..."); else None (a failure: "not implemented")."""
    if impl not in TRUSTED_ADAPTERS:
        return None
    reports = incomplete.failure.failed()
    last_lines = {r.detail.strip().splitlines()[-1] for r in reports if r.detail.strip()}
    if (
        all(r.status == "missing" for r in reports)
        and last_lines
        and all(line.startswith("NotImplementedError") and "cannot" in line for line in last_lines)
    ):
        return sorted(last_lines)[0].removeprefix("NotImplementedError: ")
    return None
