"""The libraries teams train with, run through the suite in venvs of their own (docs/libraries.md)."""
