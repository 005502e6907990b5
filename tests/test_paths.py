"""_paths: the folder that holds the package, for child processes and the shipped data."""

import os
from pathlib import Path

from qlora_nb_utils._paths import package_parent, pythonpath_with_package

ROOT = Path(__file__).resolve().parents[1]


def test_package_parent_is_the_folder_that_holds_the_package():
    assert package_parent() == ROOT
    assert (package_parent() / "qlora_nb_utils" / "__init__.py").is_file()


def test_child_pythonpath_puts_extras_first_then_the_package_then_what_was_there():
    assert pythonpath_with_package("/a:/b", "/site") == os.pathsep.join(["/site", str(ROOT), "/a:/b"])
    assert pythonpath_with_package(None, "") == str(ROOT)

