"""The third verdict, *differs by design* (issue 56): a documented behaviour of a training library
that the reference does not share, declared in the library's table entry with its source
(harness/driver/libraries/table.py, ``by_design``), never by the implementation itself and never
under the grading profile (harness/driver/plugin/options.py, ``declared_designs``).

A test judges the contract's semantics first. Only where that judgement fails, and the library
declares a design, is the whole of the same example judged again against the reference run with
that design (reference/data_parallel.train(unused_get_zero_grad=True), say); the test passes with
the difference reported, its verdict "differs by design", when every check holds there. Where the
design's judgement fails too, the contract's failure stands: a declared design never hides a wrong
value, it only explains a difference it reproduces exactly."""

from __future__ import annotations

from collections.abc import Callable

from parallelism_conformance.harness.driver.plugin.state import Designs

# the designs the reference can run, by the name a table entry declares
UNUSED_GET_ZERO_GRAD = "unused_parameters_get_zero_grad"
KNOWN = (UNUSED_GET_ZERO_GRAD,)


def judged(designs: Designs | None, contract: Callable[[], None], variants: dict[str, Callable[[], None]]) -> None:
    """``contract()`` judges the example as the contract says; where it fails, each declared design's
    ``variants[name]()`` judges the same outputs against the reference run with that design. One
    that holds throughout makes a "differs by design" finding; none: the contract's failure."""
    try:
        contract()
        return
    except AssertionError as failure:
        for name, variant in variants.items():
            if designs is None or name not in designs.declared:
                continue
            try:
                variant()
            except AssertionError as differs_too:  # the contract's failure stands; say what the design's judge saw
                failure.add_note(f"  and against the library's declared design {name}: {str(differs_too).strip().splitlines()[0][:300]}")
                continue
            what, source = designs.declared[name]
            said = f"differs by design: {what} (source: {source})"
            if not any(finding.startswith(said) for finding in designs.findings):  # once a test, from its first example
                headline = str(failure).strip().splitlines()[0][:300]
                designs.findings.append(f"{said}; the contract's check: {headline}")
            return
        raise
