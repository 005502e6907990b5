"""Padding-free batches: whole examples packed into rows of one fixed length, with document ids.

Why: on the shipped data most of the tokens in each padded batch are pad tokens (short
examples padded to the batch's length), so most of every step's FLOPs go to padding. Padding to a fixed shape is what keeps ``torch.compile`` at one graph and makes CUDA
graphs possible; packing keeps that fixed shape and drops the waste: examples are placed whole
into rows of exactly ``seq_len`` tokens, and only each row's tail is padding.

A packed row is only correct with three more things, all produced here:

* ``position_ids`` restart at 0 at every document, so rotary embeddings see each example as if
  it were alone;
* ``document_ids`` (0, 1, 2, ... per row, in order; the tail padding is ``-1``) from which
  :mod:`qlora_nb_utils.ops.doc_attention` builds the per-document causal mask, so no token
  attends across a document boundary;
* ``labels``: the first token of every document is ``-100``, so the last token of the previous
  document is never asked to predict it (alone, that first token is never predicted either, as
  the causal-LM loss shifts labels by one); the tail padding is ``-100``.

The tail padding is its own segment: its positions restart at 0 and it attends only to itself
(causally), so no query row of the mask is empty (an empty row would give NaNs in SDPA).

Packing is best-fit decreasing: examples sorted by length, longest first (ties in input order),
each into the open row with the least room that still fits it, else a new row. The result
depends only on the input order (and ``seed``, which shuffles the finished rows), never on a
global RNG. An example longer than ``seq_len`` is an error unless ``truncate=True`` is asked for
explicitly: a silent cut would train on something else than the data. Every batch has the same
shape ``(rows_per_batch, seq_len)``; the last batch is filled with all-padding rows (one
compilation, and a ``BlockMask`` whose batch size never changes).
"""

from __future__ import annotations

import bisect
import random
from dataclasses import asdict, dataclass
from typing import Any, Sequence

__all__ = ["PackingStats", "best_fit_bins", "pack_examples", "collate_packed", "real_tokens", "PAD_DOCUMENT"]

#: The document id of a row's tail padding.
PAD_DOCUMENT = -1
_IGNORE = -100


@dataclass(frozen=True)
class PackingStats:
    """How full the packed rows are.

    Attributes:
        documents: examples packed.
        rows: rows made, the filler rows of the last batch included.
        slots: ``rows * seq_len``.
        real_tokens: tokens of examples (not padding), after any truncation.
        pad_tokens: ``slots - real_tokens``.
        efficiency: ``real_tokens / slots``.
        pad_fraction: ``pad_tokens / slots``.
        truncated: examples cut to ``seq_len`` (only with ``truncate=True``).
    """

    documents: int
    rows: int
    slots: int
    real_tokens: int
    pad_tokens: int
    efficiency: float
    pad_fraction: float
    truncated: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def real_tokens(batch: dict) -> int:
    """The real (non-pad) tokens of a batch, counted one way for every run that reports tokens/s.

    A padded batch counts its ``attention_mask``; a packed batch (no mask) counts the tokens of
    its documents (``document_ids`` not :data:`PAD_DOCUMENT`); a batch with neither counts every
    token (nothing in it says which are padding).

    Raises:
        ValueError: ``batch`` has no ``input_ids``.
    """
    mask = batch.get("attention_mask")
    if mask is not None:
        return int(mask.sum())
    docs = batch.get("document_ids")
    if docs is not None:
        return int((docs != PAD_DOCUMENT).sum())
    if batch.get("input_ids") is None:
        raise ValueError(f"a batch needs input_ids to count tokens; got keys {sorted(batch)}")
    return int(batch["input_ids"].numel())


def _check_seq_len(seq_len: Any) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")


def best_fit_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bins of item indices, each bin's lengths summing to <= ``capacity``.

    Items are taken longest first (ties in index order); each goes into the open bin with the
    least room left that still fits it, or into a new bin. Within a bin, items are in the order
    they were placed. Deterministic: the same lengths give the same bins.

    Args:
        lengths: item sizes, each in ``1..capacity``.
        capacity: the size of a bin.

    Returns:
        Bins of indices into ``lengths``, in the order the bins were opened.

    Raises:
        ValueError: ``capacity`` < 2, no items, or an item of size < 1 or > ``capacity``.
    """
    _check_seq_len(capacity)
    if len(lengths) == 0:
        raise ValueError("nothing to pack: no examples")
    for i, n in enumerate(lengths):
        if not 1 <= n <= capacity:
            raise ValueError(f"example {i} has {n} tokens; a packed row holds 1..{capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin index), sorted: bisect finds the best fit
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(room, (n, -1))
        if at == len(room):
            bins.append([i])
            left, b = capacity - n, len(bins) - 1
        else:
            left, b = room.pop(at)
            bins[b].append(i)
            left -= n
        if left > 0:
            bisect.insort(room, (left, b))
    return bins


def collate_packed(documents: Sequence[Sequence[dict]], seq_len: int, pad_id: int) -> dict:
    """One packed batch: each inner list of examples becomes one row of exactly ``seq_len``.

    Args:
        documents: per row, the examples (``input_ids``, ``labels`` of equal length) in order;
            an empty list is an all-padding row.
        seq_len: the row length.
        pad_id: the token id of the tail padding.

    Returns:
        ``input_ids``, ``labels``, ``position_ids`` and ``document_ids``: int64 tensors of shape
        ``(len(documents), seq_len)`` (see the module docstring for what each holds).

    Raises:
        ValueError: a row's examples hold more than ``seq_len`` tokens, or an example's
            ``labels`` and ``input_ids`` differ in length.
    """
    import torch

    _check_seq_len(seq_len)
    shape = (len(documents), seq_len)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, _IGNORE, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    docs = torch.full(shape, PAD_DOCUMENT, dtype=torch.long)
    for r, row in enumerate(documents):
        at = 0
        for d, ex in enumerate(row):
            x, y = list(ex["input_ids"]), list(ex["labels"])
            if len(x) != len(y):
                raise ValueError(f"row {r}, document {d}: {len(x)} input_ids but {len(y)} labels")
            if at + len(x) > seq_len:
                raise ValueError(f"row {r} holds more than seq_len={seq_len} tokens")
            end = at + len(x)
            ids[r, at:end] = torch.tensor(x, dtype=torch.long)
            labels[r, at + 1:end] = torch.tensor(y[1:], dtype=torch.long)  # the first token: -100
            positions[r, at:end] = torch.arange(len(x))
            docs[r, at:end] = d
            at = end
        positions[r, at:] = torch.arange(seq_len - at)  # the tail: a segment of its own
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "document_ids": docs}


def _fit(rows: Sequence[dict], seq_len: int, truncate: bool) -> tuple[list[dict], int]:
    out, cut = [], 0
    for i, row in enumerate(rows):
        x, y = list(row["input_ids"]), list(row["labels"])
        if not x:
            raise ValueError(f"example {i} has no tokens")
        if len(x) != len(y):
            raise ValueError(f"example {i}: {len(x)} input_ids but {len(y)} labels")
        if len(x) > seq_len:
            if not truncate:
                raise ValueError(f"example {i} has {len(x)} tokens, more than seq_len={seq_len}; raise seq_len, "
                                 "drop the example, or pass truncate=True to cut it (on the right)")
            x, y, cut = x[:seq_len], y[:seq_len], cut + 1
        out.append({"input_ids": x, "labels": y})
    return out, cut


def pack_examples(rows: Sequence[dict], seq_len: int, *, rows_per_batch: int, pad_id: int,
                  truncate: bool = False, seed: int | None = None) -> tuple[list[dict], PackingStats]:
    """Pack tokenized examples into batches of shape ``(rows_per_batch, seq_len)``.

    Args:
        rows: examples with ``input_ids`` and ``labels`` (as :func:`tokenize_examples` gives;
            other fields are ignored).
        seq_len: the length of every row (>= 2).
        rows_per_batch: rows per batch; the last batch is filled with all-padding rows.
        pad_id: the token id of the padding.
        truncate: cut an example longer than ``seq_len`` on the right (counted in the stats)
            instead of raising.
        seed: shuffle the packed rows with ``random.Random(seed)``; None keeps them in the order
            best-fit decreasing opened them (longest examples first).

    Returns:
        ``(batches, stats)``: dicts of :func:`collate_packed`, and :class:`PackingStats`.

    Raises:
        ValueError: ``seq_len`` < 2, ``rows_per_batch`` < 1, no examples, an empty example,
            mismatched ``input_ids``/``labels``, or an example longer than ``seq_len`` without
            ``truncate``.
    """
    _check_seq_len(seq_len)
    if isinstance(rows_per_batch, bool) or not isinstance(rows_per_batch, int) or rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be an int >= 1, got {rows_per_batch!r}")
    if len(rows) == 0:
        raise ValueError("nothing to pack: no examples")
    examples, cut = _fit(rows, seq_len, truncate)
    bins = best_fit_bins([len(ex["input_ids"]) for ex in examples], seq_len)
    if seed is not None:
        random.Random(seed).shuffle(bins)
    bins += [[] for _ in range(-len(bins) % rows_per_batch)]
    batches = [collate_packed([[examples[i] for i in b] for b in bins[at:at + rows_per_batch]], seq_len, pad_id)
               for at in range(0, len(bins), rows_per_batch)]
    real = sum(len(ex["input_ids"]) for ex in examples)
    slots = len(bins) * seq_len
    stats = PackingStats(documents=len(examples), rows=len(bins), slots=slots, real_tokens=real,
                         pad_tokens=slots - real, efficiency=real / slots, pad_fraction=(slots - real) / slots,
                         truncated=cut)
    return batches, stats
