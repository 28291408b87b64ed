"""The table of capabilities and their files (docs/capabilities.md), generated from the registry
(harness/driver/capabilities.py) so it cannot drift: tests/test_registry.py fails when the table
differs from ``markdown()``, and ``python -m parallelism_conformance.harness.driver.capability_table`` rewrites it.
A group (the collectives) is one row."""

from __future__ import annotations

import sys
from pathlib import Path

from parallelism_conformance.harness.driver.capabilities import CAPABILITIES, Capability

TABLE = Path(__file__).resolve().parents[2] / "docs" / "capabilities.md"
BEGIN = "<!-- capability table: generated from harness/driver/capabilities.py (python -m parallelism_conformance.harness.driver.capability_table) -->"
END = "<!-- end of the capability table -->"
HEADER = (
    "| capability | CONTRACT.md | conformance | reference | bundled implementation | torch's own | mutants |\n|---|---|---|---|---|---|---|"
)


def _code(paths) -> str:
    return ", ".join(f"`{p}`" for p in paths) or "none"


def _row(name: str, members: list[Capability]) -> str:
    first = members[0]
    files = list(dict.fromkeys(f for c in members for f in c.files))
    conformance = first.conformance.removeprefix("conformance/")
    reference = [
        f.removeprefix("reference/")
        for f in files  # the cost model is the audit's row
        if f.startswith("reference/") and ("cost_model" not in f or first.name == "audit")
    ]
    impls = [f.removeprefix("impls/") for f in files if f.startswith("impls/")]
    adapters = [f.removeprefix("adapters/") for f in files if f.startswith("adapters/")]
    adapters = adapters or (["--impl torch.distributed"] if first.group == "collectives" else [])
    contract = f"§ {first.contract}" if first.contract else "each strategy's Communication"
    return (
        f"| {name} | {contract} | `{conformance}` | {_code(reference)} | {_code(impls)} | {_code(adapters)} "
        f"| {f'`{first.mutants}/`' if first.mutants else 'none'} |"
    )


def markdown() -> str:
    rows, seen = [], set()
    for capability in CAPABILITIES:
        key = capability.group or capability.name
        if key in seen:
            continue
        seen.add(key)
        members = [c for c in CAPABILITIES if (c.group or c.name) == key]
        label = f"{key} ({len(members)}: one per function, and equivalences)" if capability.group else key
        rows.append(_row(label, members))
    return "\n".join([BEGIN, HEADER, *rows, END])


def replaced(text: str) -> str:
    """``text`` (docs/capabilities.md) with its table replaced by the generated one; ValueError without markers."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{TABLE.name} lacks the markers {BEGIN!r} ... {END!r}")
    head, rest = text.split(BEGIN, 1)
    return head + markdown() + rest.split(END, 1)[1]


if __name__ == "__main__":
    TABLE.write_text(replaced(TABLE.read_text()))
    sys.exit(0)
