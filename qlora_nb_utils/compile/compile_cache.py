"""The compiled graphs of a run, kept for the next: PyTorch's cache artifacts in the user's cache folder.

Why this module exists: a new process compiles from nothing unless torch's on-disk caches
(Inductor's FX graph cache and compiled kernels, AOTAutograd's cache, all on by default) still
hold the graphs. They live in a temporary folder, which a reconnected notebook runtime, a new
container or a cleaned machine no longer has, and there the first step pays the whole compile
again. PyTorch's own answer is its cache artifacts: ``torch.compiler.save_cache_artifacts()``
serializes what this process's compiles stored in (or read from) those caches, and
``torch.compiler.load_cache_artifacts(blob)`` puts it back into them before anything compiles.
Nothing here is a cache of our own: the blob is torch's, its entries are keyed by torch on the
graph's contents, so a blob from another model or torch only misses, never misleads.

What this module adds is where the blob is kept and which one a run reads: one file per model
shape, device, torch and set of ``optimize()`` choices (:func:`cache_key`), under
``<cache folder>/compile/`` (``$QLORA_NB_CACHE``, else ``~/.cache/qlora_nb``: the models'
cache, :func:`~qlora_nb_utils.models.registry.default_cache_dir`). ``optimize()`` loads it
before the first step compiles (:meth:`CompileCache.load`) and saves it once the first step is
done, its backward compiled too (:func:`save_after_first_step`), or at ``undo()``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["CompileCache", "cache_key", "default_folder", "save_after_first_step"]

#: The config fields that make one model's compiled graphs another's: the graphs' shapes.
SHAPE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "sliding_window")


def default_folder() -> Path:
    """``<the package's cache folder>/compile``."""
    from ..models.registry import default_cache_dir

    return default_cache_dir() / "compile"


def _config(model: torch.nn.Module) -> Any:
    return next((m.config for m in model.modules() if hasattr(getattr(m, "config", None), "hidden_size")), None)


def cache_key(model: torch.nn.Module, device: torch.device, choices: dict[str, Any]) -> str:
    """The file name of ``model``'s artifacts on ``device`` with ``optimize()``'s ``choices``.

    Readable first (the model type, its layers and width, the torch version), then a digest of
    everything that makes another run's graphs differ: the model's shape fields
    (:data:`SHAPE_FIELDS`), the device's name and capability, the torch and Triton versions and
    every choice. Two runs with one key compile the same graphs from the same code.
    """
    config = _config(model)
    shape = {f: getattr(config, f, None) for f in SHAPE_FIELDS} if config is not None else {}
    dev: dict[str, Any] = {"type": device.type}
    if device.type == "cuda":
        dev.update(name=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)))
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    ident = {"shape": shape, "device": dev, "torch": torch.__version__, "triton": triton_version,
             "choices": {k: str(v) for k, v in sorted(choices.items())}}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    torch_version = torch.__version__.replace("+", "_")
    return (f"{shape.get('model_type') or type(model).__name__}-{shape.get('num_hidden_layers')}l-"
            f"{shape.get('hidden_size')}h-torch{torch_version}-{digest}.bin")


def _shown(path: Path) -> str:
    """``path`` with the home folder as ``~`` (shorter in a description)."""
    home = str(Path.home())
    text = str(path)
    return "~" + text[len(home):] if home and text.startswith(home + os.sep) else text


class CompileCache:
    """One run's artifacts file: read before the first compile, written after the first step."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.loaded_bytes = 0
        self.saved_bytes = 0
        self.error: str | None = None

    def load(self) -> str:
        """Put the file's artifacts into torch's caches (nothing compiled yet); say what was done."""
        if not self.path.is_file():
            return f"none yet at {_shown(self.path)}: this run's are saved there after its first step"
        try:
            blob = self.path.read_bytes()
            info = torch.compiler.load_cache_artifacts(blob)
        except Exception as exc:  # a damaged or foreign file: compile as if it were not there
            self.error = f"{type(exc).__name__}: {exc}"
            return f"{_shown(self.path)} could not be loaded ({self.error}): compiled anew, then saved again"
        if info is None:
            return f"{_shown(self.path)} held nothing this torch reads: compiled anew, then saved again"
        self.loaded_bytes = len(blob)
        return (f"an earlier run's compiled graphs loaded from {_shown(self.path)} ({len(blob) / 2**20:.1f} MiB): "
                f"what they cover is not compiled again")

    def save(self) -> bool:
        """Write what this process compiled or read into torch's caches (atomically); True if written.

        A file with the same bytes is left as it is. A failure to write is not the run's: it is
        kept in :attr:`error` and the run goes on.
        """
        try:
            saved = torch.compiler.save_cache_artifacts()
            if saved is None:
                return False
            blob = saved[0]
            if self.path.is_file() and self.path.stat().st_size == len(blob) and self.path.read_bytes() == blob:
                return False
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, self.path)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return False
        self.saved_bytes = len(blob)
        return True


def save_after_first_step(forward: Callable[..., Any], cache: CompileCache) -> tuple[Callable[..., Any], Callable[[], None]]:
    """``forward`` that saves ``cache`` at its second call (the first step's backward is compiled by
    then), and a ``finish()`` that saves it if that call never came (a one-step run, at ``undo()``)."""
    state = {"calls": 0, "saved": False}

    def save() -> None:
        if not state["saved"] and state["calls"]:
            state["saved"] = True
            cache.save()

    def run(**batch: Any) -> Any:
        state["calls"] += 1
        if state["calls"] == 2:
            save()
        return forward(**batch)

    run.__wrapped__ = forward  # type: ignore[attr-defined]
    return run, save
