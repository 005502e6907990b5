"""A run's batches kept on disk, so that a start with nothing changed reads them back whole.

Why: the token cache (:mod:`.token_cache`) spares a restart the tokenizing, but a start still
loads the examples through ``datasets`` (which imports pandas with it), reads the rows back,
cuts, pads or packs them in Python and collates every batch of the epoch. That runs in a thread
beside the model load, and both hold Python's interpreter lock for most of it, so the one slows
the other: on a warm start the batches were the longer of the two, or stretched the load. What
they depend on is known before any of it runs, so a start whose inputs have not changed reads
the finished batches from one file instead, and imports neither ``datasets`` nor pandas.

The key is what the batches depend on, said explicitly, and computed without reading the data:

* the source: each file's resolved path, size and modification time (the shipped files when no
  data is named, every file under a saved folder): an edited file is a new entry;
* the tokenizer (:func:`.token_cache.tokenizer_id`: its class, name, size, special ids, chat
  template and serialized rules);
* the arguments the caller names (batch size, length, seed, held-out size, packing);
* the code: torch's, transformers', tokenizers' and datasets' versions and the source files the
  caller names, so a change to how batches are made never reads batches the old code made.

Each entry is one ``torch.save`` file, written to a temporary name and renamed, read back with
``weights_only=True``; an entry that cannot be read is a miss. An epoch's batches are whole
tensors (several per token), so a large dataset's would fill a disk: batches over
:data:`MAX_ENTRY_BYTES` are not kept (the token cache still spares their tokenizing). The folder
is ``$QLORA_NB_CACHE/batches`` (else ``~/.cache/qlora_nb/batches``); deleting it is always safe.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

from .._paths import cache_root
from .token_cache import entry_name, tokenizer_id

__all__ = ["MAX_ENTRY_BYTES", "default_dir", "source_files", "key", "load", "save", "cached", "tensor_bytes"]

#: Batches whose tensors hold more bytes than this are built at every start, not kept.
MAX_ENTRY_BYTES = 1 << 30


def default_dir() -> Path:
    """``$QLORA_NB_CACHE/batches`` when that is set, else ``~/.cache/qlora_nb/batches``."""
    return cache_root() / "batches"


def source_files(data: str | os.PathLike | None) -> list[Path]:
    """The files a source's examples are read from: the shipped training and held-out files for
    None, the file itself, or every file under a saved folder (sorted)."""
    from .examples import default_data_path

    if data is None:
        return [default_data_path("train"), default_data_path("validation")]
    path = Path(data).expanduser()
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path]


def key(data: str | os.PathLike | None, tokenizer: Any, *, code: Iterable[str | os.PathLike] = (),
        **args: Any) -> str | None:
    """The entry's name for these examples, tokenizer, arguments and source files (``code``); None
    when a source file cannot be read (no entry: the caller builds, and its error surfaces there)."""
    import tokenizers
    import torch
    import transformers

    try:
        files = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in source_files(data)]
        return entry_name({"source": files, "tokenizer": tokenizer_id(tokenizer), "args": sorted(args.items()),
                           "versions": [torch.__version__, transformers.__version__, tokenizers.__version__,
                                        _datasets_version()]}, code)
    except (OSError, ValueError):
        return None


def _datasets_version() -> str:
    """datasets' version, read from its metadata (importing it is what a hit avoids)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("datasets")
    except PackageNotFoundError:
        return "none"


def load(folder: Path, name: str) -> Any | None:
    """The entry's value, or None (absent, or unreadable: a disk filled while it was written)."""
    import torch

    entry = folder / f"{name}.pt"
    if not entry.is_file():
        return None
    try:
        return torch.load(entry, weights_only=True)
    except Exception:  # a truncated or foreign file is a miss, never an error
        return None


def save(folder: Path, name: str, value: Any) -> None:
    """Write ``value`` as entry ``name``; a failure to write is no error."""
    import torch

    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError:
        return
    try:
        torch.save(value, tmp)
        os.replace(tmp, folder / f"{name}.pt")
    except OSError:  # a read-only or full disk
        pass
    finally:
        Path(tmp).unlink(missing_ok=True)


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in ``value`` (nested dicts, lists and tuples)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def cached(data: str | os.PathLike | None, tokenizer: Any, folder: Path | None, build: Callable[[], Any], *,
           code: Iterable[str | os.PathLike] = (), **args: Any) -> tuple[Any, bool]:
    """``build()``'s value for these inputs, read from ``folder`` when an entry is there, else built
    and kept there when its tensors hold at most :data:`MAX_ENTRY_BYTES` (``folder`` None: built,
    nothing kept). Returns ``(value, read_back)``."""
    name = key(data, tokenizer, code=code, **args) if folder is not None else None
    hit = load(folder, name) if name is not None else None
    if hit is not None:
        return hit, True
    value = build()
    if name is not None and tensor_bytes(value) <= MAX_ENTRY_BYTES:
        save(folder, name, value)
    return value, False
