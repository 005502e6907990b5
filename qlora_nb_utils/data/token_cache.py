"""Tokenized rows kept on disk, so that a restart does not tokenize the same data again.

Why: every start renders each example with the chat template and tokenizes the whole dataset
before its first step, even when nothing changed since the last start: a resumed
``qlora-nb train``, a notebook run again, a warm start. The cost grows with the dataset: small
for the shipped 4000 examples, the largest part of a warm start's load in the lab's warm-start
profile at Llama-3.1-8B shape, and minutes for a dataset many times larger. ``datasets.Dataset.map``'s own cache would do it, but it keys on a hash
of the tokenizer object, which changes when a call sets truncation or padding on it; here the
key is what the rows depend on, said explicitly:

* the examples: the ``datasets`` fingerprint of what :func:`~.examples.load_examples` returned
  (it changes with the file's path and modification time, a saved folder's state, ``limit``);
  a list of dicts has none and is not cached;
* the tokenizer: its class, name, size, special token ids, chat template and its serialized
  vocabulary and rules (``backend_tokenizer.to_str()``);
* the arguments (``max_len``, ``chat_template``, ``train_on_prompt``);
* the code: transformers' and tokenizers' versions and the source files the caller names
  (``code=``; :mod:`.tokenizing` names itself and :mod:`.examples`), so a change to the
  tokenization never reads rows written by the old one.

Each entry is a ``save_to_disk`` folder (memory-mapped when read back), written to a temporary
folder and renamed, with the count of dropped examples so that a hit warns as a miss did. The
folder is ``$QLORA_NB_CACHE/tokenized`` (else ``~/.cache/qlora_nb/tokenized``); deleting it is
always safe.

This module knows nothing of how rows are made: :func:`cached` is handed the function that makes
them, the source files they depend on and what to replay on a hit (the dropped-rows warning), so
that :mod:`.tokenizing` uses it and it never imports :mod:`.tokenizing` back.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

from .._paths import cache_root

__all__ = ["default_dir", "resolve", "tokenizer_id", "key", "entry_name", "load", "save", "cached"]

META = "qlora_nb_tokenized.json"


def default_dir() -> Path:
    """``$QLORA_NB_CACHE/tokenized`` when that is set, else ``~/.cache/qlora_nb/tokenized``."""
    return cache_root() / "tokenized"


def resolve(cache: bool | str | os.PathLike | None) -> Path | None:
    """The folder for ``tokenize_examples(cache=...)``: None (off), True (:func:`default_dir`) or a path."""
    if cache is None or cache is False:
        return None
    if cache is True:
        return default_dir()
    if isinstance(cache, (str, os.PathLike)):
        return Path(cache).expanduser()
    raise ValueError(f"cache must be True, False, None or a folder, got {cache!r}")


def tokenizer_id(tokenizer: Any) -> list:
    """What tokenized rows depend on in a tokenizer: its class, name, size, special token ids, chat
    template and a hash of its serialized vocabulary and rules (a slow tokenizer: its vocabulary)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        rules = backend.to_str()
    else:  # a slow tokenizer: its vocabulary is what can be read
        rules = json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = [getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")]
    return [type(tokenizer).__name__, str(getattr(tokenizer, "name_or_path", "")), len(tokenizer), specials,
            getattr(tokenizer, "chat_template", None) or "", hashlib.sha256(rules.encode()).hexdigest()]


def key(ds: Any, tokenizer: Any, *, code: Iterable[str | os.PathLike] = (), **args: Any) -> str | None:
    """The entry's name for these examples, tokenizer, arguments and source files (``code``, in
    order); None when ``ds`` has no fingerprint."""
    fingerprint = getattr(ds, "_fingerprint", None)
    if not fingerprint:
        return None
    import tokenizers
    import transformers

    return entry_name({"examples": fingerprint, "rows": len(ds), "tokenizer": tokenizer_id(tokenizer),
                       "args": sorted(args.items()), "transformers": transformers.__version__,
                       "tokenizers": tokenizers.__version__}, code)


def entry_name(parts: dict, code: Iterable[str | os.PathLike]) -> str:
    """A cache entry's name: a hash of ``parts`` (plain values) and of the source files ``code``, in
    order, so that a change to the code names other entries. Raises OSError: a file unreadable."""
    parts = {**parts, "code": hashlib.sha256(b"".join(Path(f).read_bytes() for f in code)).hexdigest()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load(folder: Path, name: str) -> tuple[Any, dict] | None:
    """``(rows, meta)`` of a complete entry, or None."""
    entry = folder / name
    if not (entry / META).is_file():
        return None
    import datasets

    try:
        meta = json.loads((entry / META).read_text())
        return datasets.load_from_disk(str(entry)), meta
    except (OSError, ValueError):  # unreadable (a disk full while written, a datasets change): a miss
        return None


def save(folder: Path, name: str, rows: Any, meta: dict) -> None:
    """Write ``rows`` (a ``datasets.Dataset``) and ``meta`` as entry ``name``; a failure to write is no error."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=folder))
    except OSError:
        return
    try:
        rows.save_to_disk(str(tmp))
        (tmp / META).write_text(json.dumps(meta))
        os.replace(tmp, folder / name)
    except OSError:  # a read-only or full disk, or another process wrote the same entry first
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cached(ds: Any, tokenizer: Any, cache: bool | str | os.PathLike, tokenize: Callable[[], Any], *,
           code: Iterable[str | os.PathLike] = (), on_hit: Callable[[dict], None] | None = None, **args: Any) -> Any:
    """``tokenize()``'s rows for ``ds``, read from the entry of ``cache`` (:func:`resolve`) when there
    is one, else made and kept there.

    Args:
        code: the source files the rows depend on (part of the :func:`key`).
        on_hit: called with the entry's meta (``dropped``, ``total``) on a hit, so that the caller
            says again what the miss said (``tokenize_examples`` warns about dropped rows).
        **args: the arguments the rows depend on (part of the :func:`key`).

    Raises:
        ValueError: a bad ``cache``; what ``tokenize`` raises.
    """
    folder = resolve(cache)
    name = key(ds, tokenizer, code=code, **args) if folder is not None else None
    hit = load(folder, name) if name is not None else None
    if hit is not None:
        rows, meta = hit
        if on_hit is not None:
            on_hit(meta)
        return rows
    rows = tokenize()
    if name is not None:
        save(folder, name, rows, {"dropped": len(ds) - len(rows), "total": len(ds)})
    return rows
