"""From the data file to the list of batches a run trains on: one builder for every caller.

Why one: the main job, the compile matrix, the optimizer bench and the FSDP2 entry each need
"``steps`` batches of ``batch_size`` rows, padded by one policy, in an order fixed by a seed",
and they differ only in how many examples they read, the padding policy and whether rows are
packed. Two runs that are compared (eager and compiled, one rank and N ranks) must see the
same batches; building them in one place keeps that true.

Packed training has its own builder, :func:`build_packed_batches`: a whole epoch of the same
examples packed into rows with document ids (:mod:`.packing`), so that a packed run and a padded
run of :func:`build_batches` can be compared on the same data.

Also here: :func:`make_length_batcher`, real text cut to any requested length (the diagnosis
over a list of sequence lengths), and :func:`pack_rows`, greedy packing of short rows into
full windows (plain concatenation, no per-document mask: for throughput runs only).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

from .collate import PaddingCollator, make_batches
from .examples import IGNORE_INDEX, as_rows, load_examples
from .packing import PackingStats, pack_examples
from .tokenizing import learned_rows, tokenize_examples

__all__ = ["build_batches", "build_packed_batches", "pack_tokenized", "cut_tokenized", "make_length_batcher", "pack_rows"]

#: Tokenize whole (``tokenize_examples(max_len=UNCUT)``): the packer decides what a too-long example becomes.
UNCUT = 1 << 30


def build_batches(tokenizer: Any, *, batch_size: int, steps: int, max_len: int, padding: str = "fixed",
                  data: str | Path | None = None, limit: int | None = None, pack: bool = False,
                  seed: int = 0, require_all: bool = False) -> list[dict]:
    """The first ``steps`` batches of the data, tokenized, padded and shuffled by ``seed``.

    Args:
        tokenizer: the model's tokenizer (with a pad token).
        batch_size: rows per batch.
        steps: how many batches.
        max_len: the longest row kept (tokenization truncates there); ``"fixed"`` pads to it.
        padding: ``"fixed"``, ``"multiple"`` or ``"longest"`` (see :class:`PaddingCollator`).
        data: a JSONL file (prompt/response, prompt/completion or messages) or a ``save_to_disk``
            folder (a DatasetDict's ``"train"`` split), as :func:`load_examples` reads; default,
            the shipped training set.
        limit: read only the first ``limit`` examples (default: all).
        pack: concatenate rows into full ``max_len`` windows first (:func:`pack_rows`).
        seed: the shuffling seed.
        require_all: raise when the data gives fewer than ``steps`` batches (else return fewer).

    Returns:
        A list of at most ``steps`` dicts of CPU tensors (``input_ids``, ``attention_mask``,
        ``labels``).

    Raises:
        ValueError: ``require_all`` and too few batches; bad padding or sizes (from the collator).
    """
    rows = tokenize_examples(load_examples(data, limit=limit), tokenizer, max_len=max_len, cache=True)
    if pack:
        rows = pack_rows(list(rows), max_len, tokenizer.pad_token_id)
    collator = PaddingCollator(pad_token_id=tokenizer.pad_token_id, policy=padding,
                               max_length=max_len if padding == "fixed" else None)
    batches = []
    for batch in make_batches(rows, batch_size, collator, seed=seed):
        batches.append(batch)
        if len(batches) == steps:
            break
    if require_all and len(batches) < steps:
        raise ValueError(f"the data gives {len(batches)} batches of {batch_size}; fewer than steps={steps}")
    return batches


def build_packed_batches(tokenizer: Any, *, batch_size: int, max_len: int, data: str | Path | None = None,
                         limit: int | None = None, seed: int = 0,
                         truncate: bool = True) -> tuple[list[dict], PackingStats]:
    """One epoch of the data packed into batches of ``batch_size`` rows of exactly ``max_len`` tokens.

    The examples are the ones :func:`build_batches` reads (the same file, ``limit`` and
    tokenization), tokenized whole and packed best-fit decreasing (:func:`pack_examples`); the
    rows are shuffled by ``seed``. An example longer than ``max_len`` is cut on the right only
    with ``truncate`` (the padded path's policy; counted in ``stats.truncated``), and one left
    without a learned token is dropped, as :func:`tokenize_examples` does.

    Returns:
        ``(batches, stats)``: dicts of CPU int64 tensors ``input_ids``, ``labels``,
        ``position_ids``, ``document_ids`` (no ``attention_mask``), and :class:`PackingStats`.

    Raises:
        ValueError: an example longer than ``max_len`` without ``truncate``; bad sizes.
    """
    rows = tokenize_examples(load_examples(data, limit=limit), tokenizer, max_len=UNCUT, cache=True)
    return pack_tokenized(rows, batch_size=batch_size, max_len=max_len, pad_id=tokenizer.pad_token_id,
                          seed=seed, truncate=truncate)


def cut_tokenized(rows: Any, max_len: int) -> Any:
    """Rows tokenized whole (``max_len=UNCUT``) as ``tokenize_examples(max_len=max_len)`` gives them.

    The tokenizer's cut is a prefix, so one tokenization serves both a packed run (whole rows)
    and a padded one (this): each row cut on the right, and a row left with no learned token
    dropped with the same warning.

    Raises:
        ValueError: ``max_len`` < 2, or no row keeps a learned token.
    """
    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an integer >= 2, got {max_len!r}")
    return learned_rows(((list(r["input_ids"])[:max_len], list(r["labels"])[:max_len]) for r in as_rows(rows)),
                        max_len, stacklevel=3)


def pack_tokenized(rows: Any, *, batch_size: int, max_len: int, pad_id: int, seed: int = 0,
                   truncate: bool = True) -> tuple[list[dict], PackingStats]:
    """:func:`build_packed_batches` on rows already tokenized whole (``input_ids``, ``labels``).

    Raises:
        ValueError: a row longer than ``max_len`` without ``truncate``; bad sizes.
    """
    rows = as_rows(rows)
    long = [i for i, r in enumerate(rows) if len(r["input_ids"]) > max_len]
    if long and not truncate:
        raise ValueError(f"{len(long)} example(s) are longer than max_len={max_len} tokens (the first: example "
                         f"{long[0]}, {len(rows[long[0]]['input_ids'])} tokens); raise max_len or allow truncation")
    kept = []
    for r in rows:
        ids, labels = list(r["input_ids"])[:max_len], list(r["labels"])[:max_len]
        if any(x != IGNORE_INDEX for x in labels[1:]):
            kept.append({"input_ids": ids, "labels": labels})
    batches, stats = pack_examples(kept, max_len, rows_per_batch=batch_size, pad_id=pad_id, seed=seed)
    return batches, dataclasses.replace(stats, truncated=len(long))


def make_length_batcher(tokenizer: Any, batch_size: int, *, data: str | Path | None = None,
                        seed: int = 0) -> Callable[[int], dict]:
    """A `make_batch(seq_len)` that cuts real examples from the shipped data to `seq_len`.

    Each call returns `batch_size` examples tokenized without truncation, then truncated
    or right-padded to exactly `seq_len` tokens, so a run over many lengths sees real text
    at every length.

    Args:
        tokenizer: the model's tokenizer (with a pad token).
        batch_size: examples per batch.
        data: a JSONL path; defaults to the shipped training set.
        seed: which examples are drawn.

    Returns:
        A function `seq_len -> batch dict` (CPU tensors).
    """
    import torch

    examples = load_examples(data, limit=max(64, 4 * batch_size))
    tokenized = tokenize_examples(examples, tokenizer, max_len=4096)
    collator = PaddingCollator(pad_token_id=tokenizer.pad_token_id, policy="longest")
    gen = torch.Generator().manual_seed(seed)

    def make_batch(seq_len: int) -> dict[str, torch.Tensor]:
        idx = torch.randperm(len(tokenized), generator=gen)[:batch_size].tolist()
        batch = collator([tokenized[i] for i in idx])
        width = batch["input_ids"].shape[1]
        if width >= seq_len:
            return {k: v[:, :seq_len].contiguous() for k, v in batch.items()}
        pad = seq_len - width
        fill = {"input_ids": tokenizer.pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX}
        return {k: torch.nn.functional.pad(v, (0, pad), value=fill[k]) for k, v in batch.items()}

    return make_batch


def pack_rows(rows: Sequence[dict], seq_len: int, pad_id: int, ignore_index: int = -100) -> list[dict]:
    """Concatenate tokenized rows into full ``seq_len`` windows (greedy, in order).

    Short chat examples padded to 2048 would be >90% padding, so throughput at a long
    sequence length is measured on packed windows: rows are appended (their labels kept,
    prompts still masked) until the next would not fit; the rest of a window is padding.
    Attention is not masked between packed rows (plain packing), which does not matter for
    speed and memory; the loss comparisons use the same windows on every world size.

    Returns:
        A list of ``{"input_ids", "labels", "length"}`` rows, each of length <= ``seq_len``.

    Raises:
        ValueError: ``seq_len`` < 2 or no rows.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2; got {seq_len}")
    if not rows:
        raise ValueError("no rows to pack")
    out, ids, labels = [], [], []
    for row in rows:
        r_ids, r_labels = list(row["input_ids"])[:seq_len], list(row["labels"])[:seq_len]
        if ids and len(ids) + len(r_ids) > seq_len:
            out.append({"input_ids": ids, "labels": labels, "length": len(ids)})
            ids, labels = [], []
        ids, labels = ids + r_ids, labels + r_labels
    if ids:
        out.append({"input_ids": ids, "labels": labels, "length": len(ids)})
    return out
