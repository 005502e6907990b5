"""Token rows from examples: the prompt masked out of the loss, EOS appended, cut on the right.

Why a module apart from :mod:`.examples`: reading and validating data is one concern, turning
it into token ids for one tokenizer and one length another, and only the second is kept on disk
between runs (:mod:`.token_cache`, ``tokenize_examples(cache=...)``): a restart reads the rows
back instead of rendering and tokenizing every example again. The cache is handed what it needs
from here (the source files the rows depend on, the dropped-rows warning to say again on a
hit) and imports nothing of this module.

Importing this module is cheap: ``datasets`` is imported by the functions that need it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import examples
from .examples import IGNORE_INDEX, as_rows, format_example
from .token_cache import cached

if TYPE_CHECKING:
    import datasets

__all__ = ["tokenize_examples", "learned_rows"]

#: The source files the rows depend on: a change to either makes the cached rows stale.
_CODE = (examples.__file__, __file__)


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
                      train_on_prompt: bool = False, cache: bool | str | Path | None = None) -> datasets.Dataset:
    """Tokenize examples of any layout for causal-LM training.

    Each row becomes ``input_ids`` (prompt, completion, then EOS unless the completion
    already ends with it), ``labels`` (a copy with prompt positions set to -100 unless
    ``train_on_prompt``) and ``length``. Rows longer than ``max_len`` are cut on the right;
    rows left with no learned token are dropped with a warning.

    Args:
        ds: a ``datasets.Dataset`` (or list of dicts) of rows in any layout (the module docstring).
        tokenizer: a Hugging Face tokenizer.
        max_len: maximum tokens per row (>= 2).
        chat_template: see :func:`format_example`.
        train_on_prompt: learn the prompt tokens too.
        cache: keep the rows on disk and read them back next time (:mod:`.token_cache`): True
            (its default folder), a folder, or None/False. A list of examples is not cached.

    Returns:
        A ``datasets.Dataset`` with columns ``input_ids``, ``labels``, ``length``.

    Raises:
        ValueError: ``max_len`` < 2, or no row keeps a learned token; a bad ``cache``.
    """
    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an integer >= 2, got {max_len!r}")
    if cache is not None and cache is not False:  # the dropped-rows warning names the caller's line, made or read back
        return cached(ds, tokenizer, cache,
                      lambda: _tokenized(ds, tokenizer, max_len, chat_template, train_on_prompt, stacklevel=6),
                      code=_CODE, on_hit=lambda meta: _warn_dropped_again(meta, max_len),
                      max_len=max_len, chat_template=chat_template, train_on_prompt=train_on_prompt)
    return _tokenized(ds, tokenizer, max_len, chat_template, train_on_prompt, stacklevel=4)


def _tokenized(ds: Any, tokenizer: Any, max_len: int, chat_template: bool, train_on_prompt: bool, *,
               stacklevel: int) -> datasets.Dataset:
    """:func:`tokenize_examples`' rows, made; ``stacklevel``: the frames up to its caller, for the
    dropped-rows warning (4 called from it directly, 6 through the token cache and a lambda)."""
    pairs = [format_example(ex, tokenizer, chat_template) for ex in as_rows(ds)]
    plain = not (chat_template and getattr(tokenizer, "chat_template", None))
    # The chat template writes its own BOS if it wants one; the plain layout lets the
    # tokenizer add its usual special tokens to the prompt.
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=plain)["input_ids"]
    completions = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    return learned_rows((_tokenize_one(p_ids, c_ids, tokenizer.eos_token_id, max_len, train_on_prompt)
                         for p_ids, c_ids in zip(prompts, completions)), max_len, stacklevel=stacklevel)


def _warn_dropped(dropped: int, total: int, max_len: int, stacklevel: int) -> None:
    warnings.warn(f"dropped {dropped} of {total} examples whose prompt fills max_len={max_len}",
                  stacklevel=stacklevel + 1)


def _warn_dropped_again(meta: dict, max_len: int) -> None:
    """On a cache hit: the warning the miss gave, pointing at ``tokenize_examples``' caller."""
    if meta.get("dropped"):  # the frames up to that caller: this, the on_hit lambda, cached, tokenize_examples
        _warn_dropped(meta["dropped"], meta["total"], max_len, stacklevel=5)


def _learns(labels: Any) -> bool:
    """Whether a row keeps a learned token (a list is counted in C, not compared token by token)."""
    if isinstance(labels, (list, tuple)):
        return labels.count(IGNORE_INDEX) < len(labels)
    return any(x != IGNORE_INDEX for x in labels)


def learned_rows(rows: Any, max_len: int, stacklevel: int = 2) -> datasets.Dataset:
    """``(input_ids, labels)`` pairs cut to ``max_len`` as a Dataset, less the rows with no learned token
    (warned; ValueError if none is left): what :func:`tokenize_examples` and ``batches.cut_tokenized`` keep."""
    import datasets

    rows = list(rows)
    kept = [(ids, labels) for ids, labels in rows if _learns(labels)]
    if not kept:
        raise ValueError(f"every example's prompt fills max_len={max_len}; raise max_len")
    if len(kept) < len(rows):
        _warn_dropped(len(rows) - len(kept), len(rows), max_len, stacklevel=stacklevel)
    return datasets.Dataset.from_dict({"input_ids": [ids for ids, _ in kept], "labels": [lab for _, lab in kept],
                                       "length": [len(ids) for ids, _ in kept]})
