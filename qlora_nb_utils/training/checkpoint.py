"""A fine-tune that can stop at any time and go on later as if it never stopped.

Why it exists: a fine-tune on a laptop or a preemptible GPU is stopped all the time, by Ctrl-C,
by a scheduler's SIGTERM, by a closed lid. What makes "go on later" worth having is that the
resumed run is *the same run*: its loss curve is the uninterrupted one, step for step. That
needs everything that decides the next step saved together, at a step boundary, and nothing
half-written ever taken for a checkpoint:

* **What is saved** (``DIR/checkpoint/``): the trainable (LoRA) weights, the optimizer and LR
  scheduler state, the step count, torch's CPU RNG state (and CUDA's on CUDA) as they were at
  that step boundary, the history so far (``history.json``), and ``meta.json``, which names
  the run: the model and a hash of its config, LoRA r/alpha, batch size, sequence length, the
  data and a hash of its files, the seed. The batches are rebuilt from the seed, and step
  ``i`` trains on batch ``i mod len``, so the data order needs no saving.
* **Atomic**: the checkpoint is written to ``checkpoint.tmp/`` and renamed into place; the
  previous one is moved aside first and deleted last (:func:`latest_checkpoint` takes it when a
  crash fell between the two renames). A folder named ``checkpoint`` is always complete.
* **Resume refuses another run**: :func:`check_resume` compares ``meta.json`` with the run asked
  for before any model loads, and names every field that differs.
* **Signals** (:class:`StopSignals`): SIGINT and SIGTERM do not kill a step half-way. Until the
  first step is done a signal stops at once (nothing to lose yet: that step is the compile);
  after it, the run stops at the end of the current step, once its evaluation and checkpoint are
  written, so that the checkpoint saved on the way out is a step boundary. A second signal stops
  at once. :class:`FinetuneInterrupted` carries the signal, hence the exit code (130, 143).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHECKPOINT",
    "FinetuneInterrupted",
    "StopSignals",
    "check_resume",
    "data_fingerprint",
    "latest_checkpoint",
    "load_checkpoint",
    "model_fingerprint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

#: the checkpoint folder's name under the run's output folder
CHECKPOINT = "checkpoint"
_STATE, _HISTORY, _META = "state.pt", "history.json", "meta.json"


class FinetuneInterrupted(KeyboardInterrupt):
    """A fine-tune stopped by SIGINT or SIGTERM, after saving what it could.

    Attributes:
        signum: the signal (``signal.SIGINT`` or ``signal.SIGTERM``).
        checkpoint: the checkpoint folder to resume from, or None when there is none.
        step: the steps done when it stopped.
        exit_code: ``128 + signum`` (130 for SIGINT, 143 for SIGTERM), what a shell expects.
    """

    def __init__(self, signum: int, checkpoint: Path | None, step: int, message: str):
        super().__init__(message)
        self.signum, self.checkpoint, self.step = int(signum), checkpoint, step
        self.exit_code = 128 + int(signum)


class StopSignals:
    """SIGINT and SIGTERM as a stop at the next step boundary (see the module docstring).

    Use as a context manager around the run (the handlers are restored on exit; outside the main
    thread nothing is installed, and Ctrl-C stays Python's KeyboardInterrupt). Set ``immediate``
    to False once a step boundary has been saved, and call :meth:`check` at each boundary.

    Attributes:
        signum: the first signal received, or None.
        immediate: whether a first signal raises at once (True until the first step is done).
        at_boundary: True when the stop was raised by :meth:`check`, i.e. the state in memory is
            a step boundary and may be saved.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.immediate = True
        self.at_boundary = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        first = self.signum is None
        if first:
            self.signum = signum
        if self.immediate or not first:
            raise KeyboardInterrupt(signal.Signals(signum).name)

    def check(self) -> None:
        """Raise KeyboardInterrupt if a signal arrived (call it at a step boundary)."""
        if self.signum is not None:
            self.at_boundary = True
            raise KeyboardInterrupt(signal.Signals(self.signum).name)


def _sha256_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def data_fingerprint(data: str | Path | None) -> dict[str, Any]:
    """The data's identity: its path (None: the shipped files) and a hash of its file(s)."""
    from ..data.examples import default_data_path

    if data is None:
        files = [default_data_path("train"), default_data_path("validation")]
    else:
        path = Path(data)
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {"data": None if data is None else str(Path(data).resolve()), "data_sha256": _sha256_files(files)}


def model_fingerprint(model: str | os.PathLike) -> dict[str, Any]:
    """The model's identity: its name (a folder: its absolute path) and a hash of its config.

    The config is the folder's ``config.json``, for a named model the one built into the cache
    (or, before it is built, the known config of a random-init model); a hub id has none.
    """
    from ..models.registry import MODEL_NAMES, default_cache_dir, model_config

    text = None
    if model in MODEL_NAMES:
        built = default_cache_dir() / str(model) / "config.json"
        if built.is_file():
            text = built.read_text()
        elif not str(model).startswith("smollm2-135m"):  # their configs come from the GGUF file
            text = model_config(str(model)).to_json_string()
        name = str(model)
    elif Path(model).expanduser().is_dir():
        folder = Path(model).expanduser().resolve()
        text, name = (folder / "config.json").read_text(), str(folder)
    else:
        name = str(model)
    if text is not None:
        text = json.dumps(json.loads(text), sort_keys=True)  # key order and spacing do not count
    return {"model": name, "model_config_sha256": hashlib.sha256(text.encode()).hexdigest()[:16] if text else None}


def latest_checkpoint(out: str | Path) -> Path | None:
    """The complete checkpoint under ``out``: ``checkpoint/``, else the one a crash left aside."""
    out = Path(out)
    for name in (CHECKPOINT, CHECKPOINT + ".old"):
        if (out / name / _META).is_file() and (out / name / _STATE).is_file():
            return out / name
    return None


def check_resume(out: str | Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Check, before any model loads, that ``out`` holds a checkpoint of the run ``meta`` names.

    Returns:
        The checkpoint's history (``steps_done``, ``losses``, ...).

    Raises:
        FileNotFoundError: no checkpoint under ``out``.
        ValueError: the checkpoint is of another run (every differing field is named).
    """
    folder = latest_checkpoint(out)
    if folder is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {Path(out) / CHECKPOINT} to resume from "
                                "(run without --resume to start)")
    saved = json.loads((folder / _META).read_text())
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {meta.get(k)!r}" for k in sorted(set(saved) | set(meta))
             if saved.get(k) != meta.get(k)]
    if diffs:
        raise ValueError(f"--resume: the checkpoint in {folder} is from another run ({'; '.join(diffs)}); "
                         "resume with the same options, or start anew with --overwrite")
    return json.loads((folder / _HISTORY).read_text())


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """torch's RNG state now: CPU, and the device's on CUDA."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put back what :func:`rng_state` took."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(out: str | Path, *, trainable: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                    scheduler: Any, rng: dict[str, torch.Tensor], history: dict[str, Any],
                    meta: dict[str, Any]) -> Path:
    """Write the checkpoint of one step boundary atomically (see the module docstring).

    Args:
        out: the run's output folder.
        trainable: the trainable weights (``trainable_state(model)``).
        optimizer: the optimizer; its ``state_dict()`` is saved.
        scheduler: the LR scheduler; its ``state_dict()`` is saved.
        rng: the RNG state taken at that boundary (:func:`rng_state`).
        history: JSON-ready; must hold ``steps_done``.
        meta: JSON-ready identity of the run.

    Returns:
        The checkpoint folder, ``out/checkpoint``.
    """
    out = Path(out)
    final, tmp, old = out / CHECKPOINT, out / (CHECKPOINT + ".tmp"), out / (CHECKPOINT + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {"trainable": {k: v.detach().cpu() for k, v in trainable.items()}, "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "step": int(history["steps_done"]),
             "rng": {k: v.cpu() for k, v in rng.items()}}
    torch.save(state, tmp / _STATE)
    (tmp / _HISTORY).write_text(json.dumps(history, default=float) + "\n")
    (tmp / _META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(out: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state, history)`` of the checkpoint under ``out`` (``state`` as :func:`save_checkpoint` wrote it).

    Raises:
        FileNotFoundError: no checkpoint.
    """
    folder = latest_checkpoint(out)
    if folder is None:
        raise FileNotFoundError(f"no checkpoint in {Path(out) / CHECKPOINT}")
    state = torch.load(folder / _STATE, map_location="cpu", weights_only=True)
    return state, json.loads((folder / _HISTORY).read_text())
