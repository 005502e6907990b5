"""Lazy public names for a package's ``__init__``: the name is imported when first used.

Why: importing ``qlora_nb_utils`` (or one of its subpackages) must stay cheap and must not
import torch, transformers or peft before the caller wants them. The Unsloth peer, for one,
runs ``python -m lab.peers.unsloth`` and has to reach ``import unsloth`` with
transformers still unloaded. A package's ``__init__`` therefore names its public entry points
in a table and lets PEP 562's module ``__getattr__`` import each from its module on first use.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Build ``__getattr__`` and ``__dir__`` for ``package`` from ``{name: "module[:attr]"}``.

    Args:
        package: the package's ``__name__``.
        table: public name -> the module that defines it, relative to ``package`` as in a
            relative import (``"loop"`` is ``package.loop``; each extra leading dot climbs one
            package: ``".compile.counting"`` from ``qlora_nb_utils.diagnostics`` is
            ``qlora_nb_utils.compile.counting``), with ``:attr`` when the attribute's name
            differs from the public one.

    Returns:
        ``(__getattr__, __dir__)`` to assign at the package's module level.
    """

    def __getattr__(name: str) -> Any:
        try:
            where = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module, _, attr = where.partition(":")
        value = getattr(importlib.import_module(f".{module}", package), attr or name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
