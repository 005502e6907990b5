"""Where the package sits on disk, said once.

Child processes (the peers, the compile-time runs, ``torchrun``) must import this very copy
of ``qlora_nb_utils``, and a clone finds its shipped data in the repository's ``data/``: both
need the folder that holds ``qlora_nb_utils/``. Computed here, from this file's fixed place
at the package's top, no module has to count how deep it sits itself (a count that went wrong
each time modules moved into subpackages). Imports nothing heavy.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["package_parent", "pythonpath_with_package"]


def package_parent() -> Path:
    """The folder that holds ``qlora_nb_utils/``: a clone's root, or site-packages when installed."""
    return Path(__file__).resolve().parent.parent


def pythonpath_with_package(existing: str | None, *first: str) -> str:
    """A ``PYTHONPATH`` for a child process: ``first`` (e.g. an extra site), this package's
    parent folder, then ``existing``; empty entries left out."""
    return os.pathsep.join(p for p in (*first, str(package_parent()), existing or "") if p)
