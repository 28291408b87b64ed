"""``python -m parallelism_conformance``: the command (cli.py)."""

import sys

from parallelism_conformance.cli import main

sys.exit(main())
