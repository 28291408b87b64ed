"""What the command hands pytest (parallelism_conformance/cli.py): paths against the directory it
runs in, names kept as names, the suite's own folder for conformance/ test paths, no ini file read."""

import os
from pathlib import Path

from parallelism_conformance.cli import PLUGIN, arguments, suite_root

CWD, ROOT = Path("/home/user/project"), Path("/site/parallelism_conformance")


def test_a_path_is_made_absolute_against_the_current_directory_and_a_name_stays_a_name():
    args = arguments(["--impl", "impl/student.py", "--report-dir=out", "--rubric", "r.toml", "-k", "SUM"], CWD, ROOT)
    assert "--impl=/home/user/project/impl/student.py" in args and "--report-dir=/home/user/project/out" in args
    assert "--rubric=/home/user/project/r.toml" in args and args[-2:] == ["-k", "SUM"]
    assert "--impl=mypkg.impl" in arguments(["--impl", "mypkg.impl"], CWD, ROOT)
    assert "--impl=torch.distributed" in arguments(["--impl=torch.distributed"], CWD, ROOT)


def test_the_suites_folder_is_run_unless_a_test_path_of_it_is_named():
    assert str(ROOT / "conformance") in arguments([], CWD, ROOT)
    named = arguments(["conformance/test_collectives.py::test_broadcast"], CWD, ROOT)
    assert str(ROOT / "conformance" / "test_collectives.py::test_broadcast") in named
    assert str(ROOT / "conformance") not in named


def test_no_ini_file_is_read_and_the_plugin_is_named():
    args = arguments([], CWD, ROOT)
    assert args[args.index("-c") + 1] == os.devnull and args[args.index("--rootdir") + 1] == str(ROOT)
    assert PLUGIN in args and "no:cacheprovider" in args


def test_an_option_without_its_value_is_left_to_pytest_to_refuse():
    assert arguments(["--impl"], CWD, ROOT)[-1] == "--impl"


def test_the_checkouts_suite_root_is_the_repository():
    assert suite_root() == Path(__file__).resolve().parent.parent
