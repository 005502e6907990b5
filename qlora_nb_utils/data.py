"""The shipped data set, its tokenization, and the padding policy that decides batch shapes.

Why a module of its own: under ``torch.compile`` the data pipeline decides how often the model
recompiles. Every distinct padded sequence length is a new input shape, so padding to the
longest example of each batch ("longest") can trigger a recompilation -- or a dynamic-shape
graph -- per batch, while padding to a multiple of 64 ("multiple") or to one fixed length
("fixed") trades wasted pad tokens for a handful of shapes. :class:`PaddingCollator` makes that
trade-off one explicit argument, and :func:`padding_stats` measures its cost.

The data itself (``data/kjv_continue_{train,validation}.jsonl``, built by
``data/build_kjv.py``) is validated line by line before ``datasets`` sees it, so a broken file
fails with its name and line number instead of deep inside pyarrow.

Importing this module is cheap: ``torch``, ``datasets`` and ``transformers`` are imported by
the functions that need them.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:
    import datasets
    import torch

SPLITS = ("train", "validation")
FILE_TEMPLATE = "kjv_continue_{split}.jsonl"
PADDING_POLICIES = ("longest", "multiple", "fixed")
IGNORE_INDEX = -100
REQUIRED_FIELDS = ("prompt", "response")
OPTIONAL_STR_FIELDS = ("id", "source")


class DataFormatError(ValueError):
    """A data file that is not one JSON object per line with non-empty ``prompt``/``response``."""


def default_data_path(split: str = "train") -> Path:
    """Return the path of the shipped data file for ``split``.

    The repository's ``data/`` folder next to the package wins (editable installs, a clone);
    otherwise the copy installed as ``qlora_nb_utils.shipped_data`` (``pip install git+URL``).

    Args:
        split: ``"train"`` or ``"validation"``.

    Returns:
        Path of ``kjv_continue_<split>.jsonl``.

    Raises:
        ValueError: unknown split.
        FileNotFoundError: neither location holds the file.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    name = FILE_TEMPLATE.format(split=split)
    repo_copy = Path(__file__).resolve().parent.parent / "data" / name
    if repo_copy.is_file():
        return repo_copy
    try:
        installed = Path(str(importlib.resources.files("qlora_nb_utils.shipped_data") / name))
    except ModuleNotFoundError:
        installed = None
    if installed is not None and installed.is_file():
        return installed
    raise FileNotFoundError(
        f"shipped data file {name} not found in {repo_copy.parent} "
        "nor in the installed package qlora_nb_utils.shipped_data"
    )


def _check_record(record: Any) -> str | None:
    """Return what is wrong with one parsed line, or None if it is a valid example."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    for key in REQUIRED_FIELDS:
        if key not in record:
            return f"missing field {key!r}"
        if not isinstance(record[key], str):
            return f"field {key!r} must be a string, got {type(record[key]).__name__}"
        if not record[key].strip():
            return f"field {key!r} is empty"
    for key in OPTIONAL_STR_FIELDS:
        if key in record and not isinstance(record[key], str):
            return f"field {key!r} must be a string, got {type(record[key]).__name__}"
    return None


def validate_file(path: str | Path) -> int:
    """Check a jsonl data file line by line; blank lines are allowed and skipped.

    Args:
        path: the file to check.

    Returns:
        The number of examples in the file.

    Raises:
        FileNotFoundError: the file does not exist.
        DataFormatError: a line is not valid JSON, not an object, lacks a non-empty string
            ``prompt`` or ``response``, has a non-string ``id``/``source``, or the file holds
            no example. The message names the file and the 1-based line number.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    count = 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            problem = _check_record(record)
            if problem:
                raise DataFormatError(f"{path}:{lineno}: {problem}")
            count += 1
    if count == 0:
        raise DataFormatError(f"{path}: no examples in file")
    return count


def load_examples(
    path: str | Path | None = None, split: str = "train", limit: int | None = None, *,
    cache_dir: str | Path | None = None,
) -> datasets.Dataset:
    """Validate and load a prompt/response jsonl file as a ``datasets.Dataset``.

    Args:
        path: a jsonl file with one ``{"prompt": ..., "response": ...}`` object per line
            (``id`` and ``source`` optional). Default: the shipped file of ``split``.
        split: which shipped file to use when ``path`` is None.
        limit: keep only the first ``limit`` examples (the shipped files are in random order,
            so this is a fair sample).
        cache_dir: where ``datasets`` keeps its Arrow cache (default: its own default).
            Nothing is downloaded; loading works with ``HF_DATASETS_OFFLINE=1``.

    Returns:
        The examples, one row per line, with the file's columns.

    Raises:
        FileNotFoundError: the file does not exist.
        DataFormatError: the file is malformed (see :func:`validate_file`).
        ValueError: ``limit`` is not a positive integer.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    path = Path(path) if path is not None else default_data_path(split)
    validate_file(path)
    import datasets

    ds = datasets.load_dataset("json", data_files=str(path), split="train",
                              cache_dir=None if cache_dir is None else str(cache_dir))
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    return ds


def format_example(example: dict, tokenizer: Any, chat_template: bool = True) -> tuple[str, str]:
    """Render one example as ``(prompt_text, completion_text)``; their concatenation is the
    full training text, and only the completion is learned by default.

    With ``chat_template=True`` and a tokenizer that has one, the prompt is a user turn and
    the response the assistant turn (the template's own turn end included, trailing
    whitespace dropped). Otherwise a plain ``### Prompt`` / ``### Response`` layout is used.

    Args:
        example: a mapping with string ``prompt`` and ``response``.
        tokenizer: a Hugging Face tokenizer.
        chat_template: use the tokenizer's chat template when it has one.

    Returns:
        ``(prompt_text, completion_text)``.

    Raises:
        ValueError: the rendered conversation does not start with the rendered prompt (a chat
            template that rewrites earlier turns), so prompt tokens cannot be masked.
    """
    prompt, response = example["prompt"], example["response"]
    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        return f"### Prompt\n{prompt}\n\n### Response\n", response
    user = [{"role": "user", "content": prompt}]
    head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(
        user + [{"role": "assistant", "content": response}], tokenize=False
    )
    if not full.startswith(head):
        raise ValueError("chat template output does not extend the prompt rendering; "
                         "use chat_template=False")
    return head, full[len(head):].rstrip()


def _tokenize_one(prompt_ids: list[int], completion_ids: list[int], eos_id: int | None,
                  max_len: int, train_on_prompt: bool) -> tuple[list[int], list[int]]:
    """Join prompt and completion ids, append EOS, build labels, truncate on the right."""
    if eos_id is not None and (not completion_ids or completion_ids[-1] != eos_id):
        completion_ids = completion_ids + [eos_id]
    input_ids = (prompt_ids + completion_ids)[:max_len]
    prompt_labels = prompt_ids if train_on_prompt else [IGNORE_INDEX] * len(prompt_ids)
    labels = (prompt_labels + completion_ids)[:max_len]
    return input_ids, labels


def tokenize_examples(ds: Any, tokenizer: Any, max_len: int = 256, chat_template: bool = True,
                      train_on_prompt: bool = False) -> datasets.Dataset:
    """Tokenize prompt/response examples for causal-LM training.

    Each row becomes ``input_ids`` (prompt, completion, then EOS unless the completion
    already ends with it), ``labels`` (a copy with prompt positions set to -100 unless
    ``train_on_prompt``) and ``length``. Rows longer than ``max_len`` are cut on the right;
    rows left with no learned token are dropped with a warning.

    Args:
        ds: a ``datasets.Dataset`` (or list of dicts) with ``prompt`` and ``response``.
        tokenizer: a Hugging Face tokenizer.
        max_len: maximum tokens per row (>= 2).
        chat_template: see :func:`format_example`.
        train_on_prompt: learn the prompt tokens too.

    Returns:
        A ``datasets.Dataset`` with columns ``input_ids``, ``labels``, ``length``.

    Raises:
        ValueError: ``max_len`` < 2, or no row keeps a learned token.
    """
    import datasets

    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an integer >= 2, got {max_len!r}")
    pairs = [format_example(ex, tokenizer, chat_template) for ex in ds]
    plain = not (chat_template and getattr(tokenizer, "chat_template", None))
    # The chat template writes its own BOS if it wants one; the plain layout lets the
    # tokenizer add its usual special tokens to the prompt.
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=plain)["input_ids"]
    completions = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    rows: dict[str, list] = {"input_ids": [], "labels": [], "length": []}
    for p_ids, c_ids in zip(prompts, completions):
        ids, labels = _tokenize_one(p_ids, c_ids, tokenizer.eos_token_id, max_len,
                                    train_on_prompt)
        if all(x == IGNORE_INDEX for x in labels):
            continue
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
        rows["length"].append(len(ids))
    dropped = len(pairs) - len(rows["length"])
    if not rows["length"]:
        raise ValueError(f"every example's prompt fills max_len={max_len}; raise max_len")
    if dropped:
        warnings.warn(f"dropped {dropped} of {len(pairs)} examples whose prompt fills "
                      f"max_len={max_len}", stacklevel=2)
    return datasets.Dataset.from_dict(rows)


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
