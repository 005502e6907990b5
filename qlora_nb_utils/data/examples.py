"""The shipped data set and its tokenization: prompt/response JSONL in, token rows out.

The data itself (``data/kjv_continue_{train,validation}.jsonl``, built by
``data/build_kjv.py``) is validated line by line before ``datasets`` sees it, so a broken file
fails with its name and line number instead of deep inside pyarrow. Tokenization renders each
example with the model's chat template and masks the prompt out of the loss.

Importing this module is cheap: ``datasets`` and ``transformers`` are imported by the
functions that need them.
"""

from __future__ import annotations

import importlib.resources
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._paths import package_parent

if TYPE_CHECKING:
    import datasets

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
    repo_copy = package_parent() / "data" / name
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
