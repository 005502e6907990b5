"""A change that can be undone exactly: reversible handles, version guards, target checks.

Why this module sits at the bottom of the package, beside ``env``: two layers hand back undo
handles. ``compile`` does (the workarounds in :mod:`qlora_nb_utils.compile.patches`, and the
other changes ``prepare_for_compile`` makes), and so does ``ops``, a layer below it (the
attention swap in :mod:`qlora_nb_utils.ops.attention`). Both need the same
:class:`PatchHandle` and :func:`set_attribute`, so neither can own them. This module imports
nothing from the package.

A patch works around one upstream behaviour that ``torch.compile`` cannot trace. Such a
workaround is only safe on the code it was written against, so each patch module:

* states the versions it was verified on (``VERIFIED_ON``) and the range it accepts
  (``SUPPORTED``), and refuses with a ``RuntimeError`` outside that range;
* checks its target (a signature, a code fingerprint) before touching it, and refuses with a
  ``RuntimeError`` naming what changed;
* records every change it makes as an *undo step*, so that :meth:`PatchHandle.undo` puts back
  the very objects that were there (not equal copies), in reverse order, once.

Nothing is patched at import time: a patch does something only when ``apply()`` is called.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping, Sequence

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = [
    "PatchHandle",
    "installed_version",
    "check_versions",
    "check_signature",
    "set_attribute",
]

_MISSING = object()


class PatchHandle:
    """A record of one applied patch; :meth:`undo` reverts it exactly.

    Attributes:
        name: The patch's name (its module name).
        details: What the patch changed, for humans and tests (e.g. ``{"hooks": 2}``).
    """

    def __init__(self, name: str, details: Mapping[str, Any] | None = None) -> None:
        self.name = name
        self.details: dict[str, Any] = dict(details or {})
        self._undo_steps: list[Callable[[], None]] = []
        self._active = True

    @property
    def active(self) -> bool:
        """True until :meth:`undo` has run."""
        return self._active

    def add_undo(self, step: Callable[[], None]) -> None:
        """Register a step that reverts one change (steps run last-in, first-out)."""
        if not self._active:
            raise RuntimeError(f"patch {self.name!r} was already undone")
        self._undo_steps.append(step)

    def undo(self) -> None:
        """Revert every change, newest first. Calling it again does nothing.

        Every step runs even if an earlier one fails; the first error is then re-raised.
        """
        if not self._active:
            return
        self._active = False
        steps, self._undo_steps = self._undo_steps, []
        first_error: BaseException | None = None
        for step in reversed(steps):
            try:
                step()
            except BaseException as exc:  # keep undoing; report the first failure
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return f"PatchHandle({self.name!r}, {state}, {self.details})"


def installed_version(package: str) -> str | None:
    """``package.__version__`` of the imported package, or None when it is not installed.

    The module attribute (not the distribution metadata) is read on purpose: it is what the
    running code is, and tests can monkeypatch it to check that a guard refuses.
    """
    try:
        module = importlib.import_module(package)
    except ImportError:
        return None
    return str(getattr(module, "__version__", "0"))


def check_versions(patch: str, supported: Mapping[str, str], verified_on: Mapping[str, str]) -> None:
    """Refuse (``RuntimeError``) when an installed version is outside its supported range.

    Args:
        patch: The patch's name, for the message.
        supported: ``{package: specifier}``, e.g. ``{"transformers": ">=5.0,<6"}``.
        verified_on: ``{package: version}`` the patch was tested with, for the message.

    Raises:
        RuntimeError: A package is missing, its version unparsable, or outside the range.
    """
    for package, spec in supported.items():
        found = installed_version(package)
        try:
            ok = found is not None and Version(found.split("+")[0]) in SpecifierSet(spec)
        except (InvalidVersion, InvalidSpecifier):
            ok = False
        if not ok:
            raise RuntimeError(
                f"patch {patch!r} supports {package}{spec} (verified on {dict(verified_on)}), "
                f"but {package} {found or 'is not installed'} is installed: its target may have "
                "changed, so the patch refuses to apply. Check whether upstream still needs it."
            )


def check_signature(patch: str, target: Callable, expected: Sequence[str]) -> None:
    """Refuse (``RuntimeError``) when ``target``'s parameter names are not ``expected``.

    Raises:
        RuntimeError: The signature differs or cannot be read.
    """
    try:
        found = list(inspect.signature(target).parameters)
    except (TypeError, ValueError) as exc:
        raise RuntimeError(f"patch {patch!r}: cannot read the signature of {target!r}: {exc}") from exc
    if found != list(expected):
        name = getattr(target, "__qualname__", repr(target))
        raise RuntimeError(
            f"patch {patch!r}: {name} has parameters {found}, expected {list(expected)}; "
            "the upstream target changed, so the patch refuses to apply"
        )


def set_attribute(handle: PatchHandle, obj: Any, name: str, value: Any) -> None:
    """``setattr(obj, name, value)`` with an undo step on ``handle`` that restores exactly.

    If ``obj`` had its own value (in its instance ``__dict__``, or the class's ``__dict__`` for
    a class), undo sets that very object back; if the value came from elsewhere (a class
    attribute seen through an instance), undo deletes the attribute so that it shows through
    again. Undo leaves the attribute alone if someone else replaced our value meanwhile.
    """
    own = vars(obj) if hasattr(obj, "__dict__") else {}
    old = own.get(name, _MISSING)
    setattr(obj, name, value)
    installed = getattr(obj, name)

    def restore() -> None:
        if getattr(obj, name, _MISSING) is not installed:
            return  # replaced since: not ours to revert
        if old is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, old)

    handle.add_undo(restore)

