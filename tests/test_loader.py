"""Loading the implementation under test (harness/rank/loader.py): one that does not exist is
"not implemented"; one that imports what this machine lacks fails naming it, since "not
implemented" would tell a student that code they wrote was never written (CS336 submissions that
import einx or read their own installed version, graded on an image without them)."""

from __future__ import annotations

import pytest

from parallelism_conformance.harness.rank.loader import MissingDependency, load_implementation


def test_an_implementation_that_does_not_exist_is_an_import_error():
    with pytest.raises(ImportError, match="no_such_implementation_xyz"):
        load_implementation("no_such_implementation_xyz")
    with pytest.raises(ImportError, match="no file"):
        load_implementation("no_such_file_xyz.py")


def test_a_package_it_imports_that_is_not_installed_is_named(tmp_path):
    (tmp_path / "student.py").write_text("import einx_not_installed_xyz\n")
    with pytest.raises(MissingDependency, match="imports 'einx_not_installed_xyz', which is not installed here"):
        load_implementation(str(tmp_path / "student.py"))


def test_reading_its_own_installed_version_when_not_installed_says_to_install_it(tmp_path):
    (tmp_path / "student.py").write_text(
        "import importlib.metadata\n__version__ = importlib.metadata.version('cs336-systems-not-installed-xyz')\n"
    )
    with pytest.raises(MissingDependency, match="installed version of 'cs336-systems-not-installed-xyz'.*pip install"):
        load_implementation(str(tmp_path / "student.py"))


def test_a_missing_dependency_is_not_a_missing_function():
    """The rank reports an ImportError as "missing" (not implemented); this one is "raised"."""
    assert not issubclass(MissingDependency, (ImportError, NotImplementedError))


def test_ranks_that_cannot_load_it_fail_the_task_at_once_naming_the_dependency():
    """Unshrinkable (every example fails alike) and not ImplementationIncomplete ("not implemented")."""
    from parallelism_conformance.harness.driver.failures import ImplementationIncomplete, ImplementationUnloadable, RankReport, task_failure

    said = "parallelism_conformance.harness.rank.loader.MissingDependency: the implementation under test 'x.py' imports 'einx', which ..."
    reports = [RankReport(rank, "unloadable", f"Traceback ...\n{said}") for rank in range(2)]
    failure = task_failure("program on 2 ranks", reports, [], 60.0, None, world_closed=False)
    assert isinstance(failure, ImplementationUnloadable) and not isinstance(failure, ImplementationIncomplete)
    assert not isinstance(failure, Exception)  # Hypothesis does not shrink what is not an Exception
    assert "cannot be loaded here" in str(failure) and "'einx'" in str(failure)
