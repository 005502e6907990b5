"""One packed batch in the form each peer's library takes it: the same documents, the same tokens.

Why it exists: the packing benchmark gives every peer the very same packed batches
(:func:`qlora_nb_utils.data.packing.pack_examples`: rows of ``seq_len`` with ``position_ids``
restarting per document and ``document_ids``), but each library reads a packed batch its own
way: our :func:`~qlora_nb_utils.compile.fast_path.optimize` takes it as it is; transformers finds
the documents from the restarting ``position_ids`` alone (no ``document_ids`` argument);
TRL's padding-free collator wants each row's documents concatenated with their lengths
(``seq_lengths``); Unsloth's padding-free path wants one flattened row with
``packed_seq_lengths``. These conversions are kept here, pure and tested on a CPU, so that
every peer trains exactly the documents, labels and real tokens of the batch as written, and
counts its tokens per step with :func:`~qlora_nb_utils.data.packing.real_tokens` of that batch.

Imports torch only inside the functions: the Unsloth child imports this module before
``import unsloth``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_packed", "for_transformers", "row_documents", "flatten_packed"]

_PAD_DOCUMENT = -1  # qlora_nb_utils.data.packing.PAD_DOCUMENT (not imported: keeps this module torch-free)


def is_packed(batch: dict) -> bool:
    """A packed batch carries ``document_ids``; a padded one an ``attention_mask``."""
    return "document_ids" in batch


def for_transformers(batch: dict) -> dict:
    """The batch a plain transformers model takes: ``document_ids`` dropped.

    transformers (5.x) rebuilds the per-document causal mask from ``position_ids`` that restart
    at 0 when no ``attention_mask`` is given; the tail padding, whose positions restart too, is a
    segment of its own and its labels are ``-100``.
    """
    return {k: v for k, v in batch.items() if k != "document_ids"}


def row_documents(batch: dict) -> list[dict[str, Any]]:
    """Each row's documents concatenated, tail padding dropped: TRL's padding-free examples.

    Returns:
        One dict per row that holds a document: ``input_ids`` and ``labels`` (lists, labels as
        packed: each document's first token ``-100``), ``seq_lengths`` (the documents' lengths,
        in order). All-padding rows (the filler of a last batch) are left out.
    """
    out = []
    docs, ids, labels = batch["document_ids"], batch["input_ids"], batch["labels"]
    for r in range(int(ids.shape[0])):
        keep = docs[r] != _PAD_DOCUMENT
        n = int(keep.sum())
        if n == 0:
            continue
        row_docs = docs[r][keep]
        lengths = [int(c) for c in row_docs.unique_consecutive(return_counts=True)[1]]
        out.append({"input_ids": ids[r][keep].tolist(), "labels": labels[r][keep].tolist(), "seq_lengths": lengths})
    return out


def flatten_packed(batch: dict) -> dict:
    """All documents of a packed batch in one row, tail padding dropped: Unsloth's padding-free batch.

    Returns:
        ``input_ids``, ``labels``, ``position_ids`` (1, T) int64 with T the batch's real tokens,
        and ``packed_seq_lengths`` (int32, one length per document, summing to T).

    Raises:
        ValueError: the batch holds no document.
    """
    import torch

    rows = row_documents(batch)
    if not rows:
        raise ValueError("the packed batch holds no document (all rows are padding)")
    lengths = [n for row in rows for n in row["seq_lengths"]]
    ids = torch.tensor([t for row in rows for t in row["input_ids"]], dtype=torch.long)[None]
    labels = torch.tensor([t for row in rows for t in row["labels"]], dtype=torch.long)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions,
            "packed_seq_lengths": torch.tensor(lengths, dtype=torch.int32)}
