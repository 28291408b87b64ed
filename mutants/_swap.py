"""A mutant's bug as a temporary swap: ``with swapped(module, name=replacement): ...`` puts each
replacement in place of ``module.name`` for the call and restores the original after it, even when
the call raises (a refusal the suite asks for), so the bundled implementation stays intact for the
next task in the same rank."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def swapped(module, **replacements):
    originals = {name: getattr(module, name) for name in replacements}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        yield originals
    finally:
        for name, value in originals.items():
            setattr(module, name, value)
