"""The suite's one import name: every module of it is ``parallelism_conformance.<folder>.<module>``,
and nothing else lands at the top level of an environment it is installed into.

Installed (a wheel, an sdist), the folders ``reference``, ``impls``, ``harness``, ``conformance``,
``adapters`` and ``parallelize_examples`` are subpackages inside this one (setup.py maps each folder under it). In a checkout they
stay at the repository's top level, as the project's layout has them: this package's search path
then ends with the repository root, so ``parallelism_conformance.reference`` is ``reference/`` and
no file exists twice. Which of the two holds is read from the disk, once, here."""

import os

__version__ = "0.1.0"  # read as data (ast) by the reports and by setuptools, never by importing the package

_here = os.path.dirname(os.path.abspath(__file__))
if not os.path.isdir(os.path.join(_here, "harness")):  # a checkout: the folders are the root's
    __path__.append(os.path.dirname(_here))  # noqa: F821 - a package's __path__ is set before its code runs
