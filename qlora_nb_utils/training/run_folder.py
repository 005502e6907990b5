"""A ``qlora-nb train`` output folder, read and checked before any model loads.

Why it exists: ``qlora-nb export`` and ``qlora-nb generate`` start from a run folder, and a wrong
one (a typo, another tool's folder, a run whose base model has gone from this machine) must fail
in a second with a message, not minutes into loading a model. Both need the same few facts, read
here once: the base model the adapter was trained against (``metrics.json``'s ``model``), the
dtype the run computed in (the dtype the NF4 weights were quantized from), and the adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TrainedRun", "read_run", "check_base_available"]

_TRAIN_HINT = "a folder written by `qlora-nb train --out DIR`"


@dataclass(frozen=True)
class TrainedRun:
    """What export and generate need of a run folder.

    Attributes:
        folder: the run folder.
        model: the base as the run named it (a name of ``models.MODEL_NAMES``, a folder or a hub id).
        dtype: the dtype the run computed in (``"float32"``, ``"bfloat16"``, ...): the base was read
            in it and then quantized to NF4.
        metrics: ``metrics.json`` as written.
    """

    folder: Path
    model: str
    dtype: str
    metrics: dict[str, Any]

    @property
    def adapter(self) -> Path:
        return self.folder / "adapter"


def read_run(folder: str | Path) -> TrainedRun:
    """Read the run in ``folder``; nothing is loaded but two small files.

    Raises:
        ValueError: no such folder, or one without ``adapter/adapter_config.json`` or a readable
            ``metrics.json`` naming the model, or whose base cannot be found (:func:`check_base_available`).
    """
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise ValueError(f"{folder}: no such folder (expected {_TRAIN_HINT})")
    if not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a run folder (expected {_TRAIN_HINT})")
    if not (folder / "adapter" / "adapter_config.json").is_file():
        raise ValueError(f"{folder} is not a qlora-nb train run: it has no adapter/adapter_config.json "
                         f"(expected {_TRAIN_HINT})")
    metrics_file = folder / "metrics.json"
    if not metrics_file.is_file():
        raise ValueError(f"{folder} is not a qlora-nb train run: it has no metrics.json (expected {_TRAIN_HINT})")
    try:
        metrics = json.loads(metrics_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{metrics_file} is not valid JSON ({err})") from None
    if not isinstance(metrics, dict):
        raise ValueError(f"{metrics_file} is not a qlora-nb train metrics file (a JSON {type(metrics).__name__})")
    # meta's name: a folder as an absolute path (the option may be relative to where train ran)
    model = (metrics.get("meta") or {}).get("model") or metrics.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(f"{metrics_file} names no model (no \"model\" field): not a qlora-nb train run")
    check_base_available(model, run=folder)
    return TrainedRun(folder=folder, model=model, dtype=_run_dtype(metrics), metrics=metrics)


def _run_dtype(metrics: dict[str, Any]) -> str:
    """The dtype the run computed in: the one ``optimize`` recorded, else the option, else float32."""
    chosen = (metrics.get("optimize") or {}).get("choices", {}).get("dtype")
    option = (metrics.get("options") or {}).get("dtype")
    for value in (chosen, option):
        if isinstance(value, str) and value not in ("auto", ""):
            return value.replace("torch.", "")
    return "float32"


def check_base_available(model: str, *, run: Path | None = None) -> None:
    """Check that the base ``model`` can be loaded here, loading nothing.

    A named model is built on first use; a folder must still exist and hold a model; a hub id must
    be in the local Hugging Face cache when the hub is offline (``HF_HUB_OFFLINE``), else it would
    fail deep inside ``from_pretrained``.

    Raises:
        ValueError: the base cannot be found, naming the run that needs it.
    """
    from ..models.registry import HUB_ID, MODEL_NAMES, check_model_source

    where = f" (the base model of the run in {run})" if run is not None else ""
    if model in MODEL_NAMES:
        return
    path = Path(model).expanduser()
    if path.is_absolute() or path.exists() or not HUB_ID.fullmatch(model):
        if not path.is_dir():
            raise ValueError(f"base model {model} not found{where}: the folder is gone; "
                             "put it back or train again")
        try:
            check_model_source(model)
        except ValueError as err:
            raise ValueError(f"base model{where}: {err}") from None
        return
    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(model, "config.json")
    if constants.HF_HUB_OFFLINE and not isinstance(cached, str):
        raise ValueError(f"base model {model}{where} is not in the local Hugging Face cache and the hub is "
                         "offline (HF_HUB_OFFLINE): download it first, or unset HF_HUB_OFFLINE")
