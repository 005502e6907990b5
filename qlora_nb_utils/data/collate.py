"""The padding policy that decides batch shapes, and what it costs.

Why a module of its own: under ``torch.compile`` the data pipeline decides how often the model
recompiles. Every distinct padded sequence length is a new input shape, so padding to the
longest example of each batch ("longest") can trigger a recompilation -- or a dynamic-shape
graph -- per batch, while padding to a multiple of 64 ("multiple") or to one fixed length
("fixed") trades wasted pad tokens for a handful of shapes. :class:`PaddingCollator` makes that
trade-off one explicit argument, and :func:`padding_stats` measures its cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from .examples import IGNORE_INDEX, PADDING_POLICIES

if TYPE_CHECKING:
    import torch


@dataclass
class PaddingCollator:
    """Pad a list of tokenized rows on the right into ``input_ids``/``attention_mask``/``labels``.

    Policies (each distinct padded length is a distinct input shape for ``torch.compile``):

    * ``"longest"``: pad to the longest row of the batch (least waste, most shapes);
    * ``"multiple"``: pad up to the next multiple of ``multiple_of`` (a few shapes);
    * ``"fixed"``: always pad to ``max_length`` (one shape, most waste).

    ``max_length`` is required for ``"fixed"``; with the other policies it is an optional cap
    (a longer row is an error, and ``"multiple"`` never pads beyond it).

    Args:
        pad_token_id: id written into padded ``input_ids`` positions.
        policy: one of ``"longest"``, ``"multiple"``, ``"fixed"``.
        multiple_of: the bucket size of ``"multiple"``.
        max_length: target length of ``"fixed"``; cap for the others.
        label_pad: value of padded ``labels`` positions (ignored by the loss).

    Raises:
        ValueError: unknown policy, ``"fixed"`` without ``max_length``, non-positive sizes.
    """

    pad_token_id: int
    policy: str = "longest"
    multiple_of: int = 64
    max_length: int | None = None
    label_pad: int = IGNORE_INDEX

    def __post_init__(self) -> None:
        if self.policy not in PADDING_POLICIES:
            raise ValueError(f"unknown padding policy {self.policy!r}; "
                             f"valid policies: {', '.join(PADDING_POLICIES)}")
        if not isinstance(self.pad_token_id, int):
            raise ValueError(f"pad_token_id must be an int, got {self.pad_token_id!r} "
                             "(a tokenizer without a pad token needs one chosen explicitly)")
        if self.policy == "fixed" and self.max_length is None:
            raise ValueError("policy 'fixed' needs max_length")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be positive, got {self.max_length}")
        if self.multiple_of < 1:
            raise ValueError(f"multiple_of must be positive, got {self.multiple_of}")

    def target_length(self, longest: int) -> int:
        """The padded length of a batch whose longest row has ``longest`` tokens.

        Raises:
            ValueError: ``longest`` exceeds ``max_length``.
        """
        if self.max_length is not None and longest > self.max_length:
            raise ValueError(f"a row has {longest} tokens, more than max_length="
                             f"{self.max_length}; truncate when tokenizing "
                             "(tokenize_examples(max_len=...)) or raise max_length")
        if self.policy == "fixed":
            return self.max_length
        if self.policy == "multiple":
            padded = math.ceil(longest / self.multiple_of) * self.multiple_of
            return padded if self.max_length is None else min(padded, self.max_length)
        return longest

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        """Collate rows with ``input_ids`` (and optionally ``labels``; default: a copy).

        Returns:
            ``{"input_ids", "attention_mask", "labels"}``, int64 tensors of shape
            ``(len(features), target_length)``.
        """
        import torch

        if not features:
            raise ValueError("cannot collate an empty list of rows")
        lengths = [len(f["input_ids"]) for f in features]
        width = self.target_length(max(lengths))
        shape = (len(features), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, self.label_pad, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        for i, (row, n) in enumerate(zip(features, lengths)):
            input_ids[i, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            labels[i, :n] = torch.as_tensor(row.get("labels", row["input_ids"]), dtype=torch.long)
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def make_batches(tokenized: Any, batch_size: int, collator: PaddingCollator, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True) -> torch.utils.data.DataLoader:
    """Wrap tokenized rows in a ``DataLoader`` whose order depends only on ``seed``.

    Two loaders built with the same arguments yield the same batches; successive epochs of
    one loader are shuffled differently (its generator advances).

    Args:
        tokenized: output of :func:`tokenize_examples` (or any indexable of row dicts).
        batch_size: rows per batch.
        collator: turns a list of rows into tensors.
        seed: seed of the shuffling generator.
        shuffle: shuffle rows each epoch.
        drop_last: drop a final short batch (a short batch is one more shape to compile).

    Returns:
        A ``torch.utils.data.DataLoader`` (single process).

    Raises:
        ValueError: ``batch_size`` < 1, or ``drop_last`` leaves no batch.
    """
    from torch import Generator
    from torch.utils.data import DataLoader

    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if drop_last and len(tokenized) < batch_size:
        raise ValueError(f"{len(tokenized)} rows make no full batch of {batch_size} "
                         "(drop_last=True)")
    generator = Generator().manual_seed(seed)
    return DataLoader(tokenized, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                      collate_fn=collator, generator=generator)


def padding_stats(batches: Iterable[dict]) -> dict[str, Any]:
    """Count real and pad tokens over collated batches.

    Args:
        batches: dicts with an ``attention_mask`` tensor (as from :class:`PaddingCollator`).

    Returns:
        ``batches``, ``real_tokens``, ``padded_tokens`` (pad positions), ``total_tokens``,
        ``waste_fraction`` (padded / total) and ``shapes`` (sorted distinct ``(batch, seq)``
        shapes, i.e. what ``torch.compile`` would see).

    Raises:
        ValueError: no batches.
    """
    n = real = total = 0
    shapes = set()
    for batch in batches:
        mask = batch["attention_mask"]
        n += 1
        real += int(mask.sum())
        total += mask.numel()
        shapes.add(tuple(mask.shape))
    if n == 0:
        raise ValueError("padding_stats got no batches")
    return {"batches": n, "real_tokens": real, "padded_tokens": total - real,
            "total_tokens": total, "waste_fraction": (total - real) / total,
            "shapes": sorted(shapes)}
