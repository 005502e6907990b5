"""The batches of a ``qlora-nb train`` run: bucketed padding or packing, in an order fixed by the seed.

Why a module of its own: the batch shapes decide what ``optimize`` can do with the step, and the
same arguments must give the same batches (what ``--resume`` relies on), so how they are built is
one decision, made here, from the tokenizer alone (no model):

* **Padding: buckets of a quarter of ``seq_len``** (``PaddingCollator`` ``"multiple"``), so at
  most 4 batch shapes. On a GPU that lets ``optimize`` choose CUDA graphs (one per shape); on a
  CPU it compiles once (several lengths are marked dynamic from the first call, one length is
  static). ``"longest"`` wastes fewer pad tokens but shows many shapes, so no CUDA graphs;
  ``"fixed"`` shows one shape but pads every short example to ``seq_len``. At ``seq_len`` 128 on
  the shipped data nearly every row is cut to 128, so the buckets are one shape there.
* **Packing where it pays** (``packing="auto"``): when the bucketed batches would be more than
  :data:`PACK_WHEN_PADDING_OVER` padding, the epoch is packed instead (whole examples in rows of
  ``seq_len``, each attending to itself only: :func:`~qlora_nb_utils.data.build_packed_batches`),
  and the choice is stated with both pad fractions. On the shipped data at ``seq_len`` 128
  nearly every example fills a row, so nothing is packed; at 1024 a padded batch is mostly
  padding. The held-out batches stay padded: the loss per learned token is the same either way.
* **Data order from the seed**: the batches of one epoch are built in a seeded order and step
  ``i`` trains on batch ``i mod len``, so a resumed run sees what the uninterrupted one saw.
* **Kept for the next start**: the same source files, tokenizer and options give the same
  batches, so they are kept on disk (:mod:`~qlora_nb_utils.data.batch_cache`) and a restart
  reads them back instead of loading, tokenizing and packing the data again beside the model load.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

__all__ = ["PACK_WHEN_PADDING_OVER", "build_finetune_batches"]

#: ``packing="auto"`` packs when the padded batches would hold more than this share of padding.
PACK_WHEN_PADDING_OVER = 0.25


def _bucket(seq_len: int) -> int:
    """A quarter of ``seq_len``, rounded up to a multiple of 8: at most 4 padded lengths."""
    return ((seq_len + 3) // 4 + 7) // 8 * 8


def build_finetune_batches(tokenizer: Any, *, data: str | Path | None = None, batch_size: int = 4,
                           seq_len: int = 128, seed: int = 0, eval_size: int = 32,
                           log: Callable[[str], None] | None = None,
                           packing: bool | str = False, cache: bool = True) -> tuple[list, list, dict]:
    """The training and held-out batches of a run, and the held-out example shown as a sample.

    Training: one epoch of the training split, tokenized (prompt masked), shuffled by ``seed``,
    in batches of ``batch_size`` padded to buckets of a quarter of ``seq_len`` (module
    docstring), or packed (``packing=True``; ``"auto"``: packed when the padded batches would be
    more than :data:`PACK_WHEN_PADDING_OVER` padding, the choice logged). Held out:
    ``data.load_splits(eval_size)``'s held-out split, in order, padded. The same arguments give
    the same batches (what ``--resume`` relies on).

    ``cache``: keep the tokenized rows (:mod:`~qlora_nb_utils.data.token_cache`) and the finished
    batches (:mod:`~qlora_nb_utils.data.batch_cache`) on disk, so that a start whose data,
    tokenizer and arguments are unchanged reads the batches back instead of building them (the
    same batches, and the same lines logged, with one more saying so). False: build, keep nothing.

    Returns:
        ``(train_batches, heldout_batches, sample_example)``: lists of dicts of CPU tensors, and
        the first held-out example as it is in the data.
    """
    from ..data import batch_cache

    said: list[str] = []

    def build() -> dict:
        train, heldout, example = _build(tokenizer, data=data, batch_size=batch_size, seq_len=seq_len, seed=seed,
                                         eval_size=eval_size, log=said.append, packing=packing, cache=cache)
        return {"train": train, "heldout": heldout, "example": example, "log": said}

    folder = batch_cache.default_dir() if cache else None
    built, read_back = batch_cache.cached(data, tokenizer, folder, build, code=_code_files(), batch_size=batch_size,
                                          seq_len=seq_len, seed=seed, eval_size=eval_size, packing=packing)
    for line in built["log"]:
        (log or print)(line)
    if read_back:
        (log or print)(f"==> batches read back from {folder} (data, tokenizer and options as when they were built)")
    return built["train"], built["heldout"], built["example"]


def _code_files() -> list[str]:
    """The source files the batches depend on (part of the batch cache's key)."""
    from ..data import batches, collate, examples, packing, token_cache, tokenizing

    return [__file__, *(m.__file__ for m in (batches, collate, examples, packing, token_cache, tokenizing))]


def _build(tokenizer: Any, *, data: str | Path | None, batch_size: int, seq_len: int, seed: int, eval_size: int,
           log: Callable[[str], None], packing: bool | str, cache: bool) -> tuple[list, list, dict]:
    """:func:`build_finetune_batches`'s batches, built (``cache``: tokenized rows read back where
    the token cache keeps them)."""
    from .. import data as data_package
    from ..data import (
        UNCUT,
        PaddingCollator,
        cut_tokenized,
        load_splits,
        make_batches,
        pack_tokenized,
        padding_stats,
        tokenize_examples,
    )

    train_ds, held_ds = load_splits(data, max_eval=eval_size, seed=seed)
    whole = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = None
        if packing is not False:  # tokenized once, whole: packed below (and cut here, for auto's padded batches)
            whole = tokenize_examples(train_ds, tokenizer, max_len=UNCUT, cache=cache)  # a restart reads it back
            if packing is not True:  # "auto" weighs the padded batches too
                rows = cut_tokenized(whole, seq_len)
        else:
            rows = tokenize_examples(train_ds, tokenizer, max_len=seq_len, cache=cache)
        held = tokenize_examples(held_ds, tokenizer, max_len=seq_len, cache=cache)
    # The rows' own warnings (dropped examples, raised in the data package or here) become notes;
    # catch_warnings is process-wide, so what another thread warned meanwhile (the model load beside
    # this) is given back as it was
    here, data_folder = Path(__file__).resolve(), Path(data_package.__file__).resolve().parent
    for w in caught:
        where = Path(w.filename).resolve()
        if where == here or where.parent == data_folder:
            log(f"note: {w.message} (--seq-len {seq_len})")
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    collator = PaddingCollator(pad_token_id=tokenizer.pad_token_id, policy="multiple",
                               multiple_of=_bucket(seq_len), max_length=seq_len)
    # packing asked for: no padded batches, which only "auto" weighs against the packed ones
    train = list(make_batches(rows, batch_size, collator, seed=seed)) if rows is not None else None
    heldout = list(make_batches(held, batch_size, collator, shuffle=False, drop_last=False))
    if packing is not False:
        waste = padding_stats(train)["waste_fraction"] if train is not None else None
        if packing is True or waste > PACK_WHEN_PADDING_OVER:
            train, stats = pack_tokenized(whole, batch_size=batch_size, max_len=seq_len,
                                          pad_id=tokenizer.pad_token_id, seed=seed)
            why = "asked for" if packing is True else f"padded batches would be {waste:.0%} padding"
            log(f"==> packing: on ({why}): {len(train)} packed batches, {stats.pad_fraction:.0%} "
                f"padding, {stats.truncated} example(s) cut to {seq_len} tokens")
        else:
            log(f"==> packing: off (padded batches are {waste:.0%} padding, "
                f"<= {PACK_WHEN_PADDING_OVER:.0%})")
    else:
        log(f"==> packing: off (asked for): padded batches are "
            f"{padding_stats(train)['waste_fraction']:.0%} padding")
    return train, heldout, dict(held_ds[0])
