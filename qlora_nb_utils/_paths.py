"""Where the package and its caches sit on disk, said once; and whether a command can write where it is asked to.

Child processes (the peers, the compile-time runs, ``torchrun``) must import this very copy
of ``qlora_nb_utils``, and a clone finds its shipped data in the repository's ``data/``: both
need the folder that holds ``qlora_nb_utils/``. Computed here, from this file's fixed place
at the package's top, no module has to count how deep it sits itself (a count that went wrong
each time modules moved into subpackages). Imports nothing heavy.

A command that trains for minutes and then cannot write its results loses them, so every
command checks its output path first, before any model loads (:func:`check_out_dir`,
:func:`check_out_file`).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["package_parent", "pythonpath_with_package", "cache_root", "check_out_dir", "check_out_file"]


def package_parent() -> Path:
    """The folder that holds ``qlora_nb_utils/``: a clone's root, or site-packages when installed."""
    return Path(__file__).resolve().parent.parent


def pythonpath_with_package(existing: str | None, *first: str) -> str:
    """A ``PYTHONPATH`` for a child process: ``first`` (e.g. an extra site), this package's
    parent folder, then ``existing``; empty entries left out."""
    return os.pathsep.join(p for p in (*first, str(package_parent()), existing or "") if p)


def cache_root() -> Path:
    """The package's cache folder (built models, tokenized rows, batches, compiled graphs):
    ``$QLORA_NB_CACHE`` when set and non-empty, else ``~/.cache/qlora_nb``."""
    configured = os.environ.get("QLORA_NB_CACHE", "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "qlora_nb"


def check_out_dir(path: str, *, what: str = "--out", empty: bool = False) -> Path:
    """Check, before anything loads, that a command can write its folder ``path``; return it.

    Raises:
        ValueError: ``path`` is a file, or (``empty``) a folder that is not empty, or a file stands
            where a parent folder must go, or the nearest existing parent is not writable.
    """
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{what} {out} is a file, not a folder: name a folder to write into")
    if empty and out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{what} {out} exists and is not empty: pass --overwrite to replace it")
    _check_parent_writable(out, what)
    return out


def check_out_file(path: str, *, what: str) -> Path:
    """Check, before anything loads, that a command can write the file ``path``; return it.

    Raises:
        ValueError: ``path`` is a folder, a file stands where a parent folder must go, or the
            nearest existing parent is not writable.
    """
    out = Path(path).expanduser()
    if out.is_dir():
        raise ValueError(f"{what} {out} is a folder: name the file to write")
    _check_parent_writable(out, what)
    return out


def _check_parent_writable(out: Path, what: str) -> None:
    parent = out if out.is_dir() else out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {out}: {parent} is a file, so the folder cannot be made")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {out}: {parent} is not writable")
