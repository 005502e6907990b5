"""What a training process need not import before its first step.

Why this module exists: every second between launching ``qlora-nb train`` and its first step is
waited for, cold cache or warm, and a part of the imports serves nothing a training run uses.
transformers' assisted-generation module (imported by ``peft`` through transformers' auto
classes) imports scikit-learn's metrics wherever scikit-learn is installed, as it is on Colab,
Kaggle and most GPU images, for one function, ``roc_curve``, called only when assisted
generation tunes its confidence threshold. scikit-learn brings SciPy's statistics and pandas
with it, all imported at every start for nothing.

:func:`defer_sklearn` imports that module with scikit-learn out of its sight and gives it a
``roc_curve`` that imports scikit-learn's at its first call and hands the call on. Everything
behaves as before (assisted generation included); a process that never calls it never pays for
the import. Like the package's patches (:mod:`.reversible`) it is explicit and undone exactly:
nothing happens at import; the command line applies it at the start of the commands that load
models (``cli.prepare_command``), and each rank of the distributed launchers
(``distributed.runs.run_main``) after its arguments are checked; ``undo()`` puts scikit-learn's
own function in place. It checks its target rather than a version range: where transformers no
longer asks whether scikit-learn is installed when that module is imported, or that module was
already imported, it changes nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

from .reversible import PatchHandle

__all__ = ["defer_sklearn", "CANDIDATES", "VERIFIED_ON"]

#: The transformers module that imports ``sklearn.metrics.roc_curve`` when it is imported.
CANDIDATES = "transformers.generation.candidate_generator"
#: What it was written and checked against.
VERIFIED_ON = {"transformers": "5.17.0", "scikit-learn": "1.9.1"}


def _roc_curve(*args: Any, **kwargs: Any) -> Any:
    """scikit-learn's ``roc_curve``, imported at the first call (the module keeps the real one then)."""
    from sklearn.metrics import roc_curve

    module = sys.modules.get(CANDIDATES)
    if module is not None and getattr(module, "roc_curve", None) is _roc_curve:
        module.roc_curve = roc_curve
    return roc_curve(*args, **kwargs)


def defer_sklearn() -> PatchHandle | None:
    """Import transformers' assisted-generation module without importing scikit-learn.

    Returns:
        A handle whose ``undo()`` imports scikit-learn's ``roc_curve`` and puts it in the module;
        None where nothing was changed: scikit-learn or transformers not installed, the module
        (or scikit-learn's metrics) already imported, or a transformers whose module no longer
        asks at import time (the module is then imported as it is).
    """
    if CANDIDATES in sys.modules or "sklearn.metrics" in sys.modules:
        return None
    if importlib.util.find_spec("sklearn") is None or importlib.util.find_spec("transformers") is None:
        return None
    utils = importlib.import_module("transformers.utils")
    real = getattr(utils, "is_sklearn_available", None)
    if real is None:
        return None
    asked = []

    def hidden() -> bool:  # False to the module's own import-time question only
        if sys._getframe(1).f_globals.get("__name__") == CANDIDATES:
            asked.append(True)
            return False
        return real()

    before = set(sys.modules)
    utils.is_sklearn_available = hidden
    try:
        module = importlib.import_module(CANDIDATES)
    finally:
        utils.is_sklearn_available = real
        for name in set(sys.modules) - before:  # each module imported meanwhile keeps the real function
            new = sys.modules.get(name)
            if getattr(new, "is_sklearn_available", None) is hidden:
                new.is_sklearn_available = real
    if not asked or hasattr(module, "roc_curve"):
        return None
    handle = PatchHandle("startup.defer_sklearn", {"module": CANDIDATES, "deferred": "sklearn.metrics.roc_curve"})
    module.roc_curve = _roc_curve

    def restore() -> None:
        if getattr(module, "roc_curve", None) is _roc_curve:
            from sklearn.metrics import roc_curve

            module.roc_curve = roc_curve

    handle.add_undo(restore)
    return handle
