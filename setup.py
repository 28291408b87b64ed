"""Packaging: the repository's top-level folders become subpackages of ``parallelism_conformance``
in the wheel and the sdist (parallelism_conformance/__init__.py says why the checkout keeps them at
the top). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

PACKAGE = "parallelism_conformance"
FOLDERS = ("reference", "impls", "harness", "conformance", "adapters", "parallelize_examples")  # the last: known plans, --parallelize
DATA = {"grading": ["rubric.toml", "cs336-requirements.txt", "gradescope/*"]}  # read by path, not imported

packages, package_dir = [PACKAGE], {PACKAGE: PACKAGE}
for folder in FOLDERS:
    for sub in [folder, *(f"{folder}.{p}" for p in find_packages(folder))]:
        packages.append(f"{PACKAGE}.{sub}")
        package_dir[f"{PACKAGE}.{sub}"] = sub.replace(".", "/")
for folder in DATA:
    packages.append(f"{PACKAGE}.{folder}")
    package_dir[f"{PACKAGE}.{folder}"] = folder

setup(packages=packages, package_dir=package_dir, package_data={f"{PACKAGE}.{folder}": files for folder, files in DATA.items()})
