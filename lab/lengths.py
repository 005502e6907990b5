"""A long-tailed length distribution shaped like a real instruction data set, drawn offline.

Why it exists: the shipped data (``data/kjv_continue_train.jsonl``) is short and narrow (4,000
examples of 69-265 tokens with the 1B shape's tokenizer, median 169), so packing it says little
about what a user's chat data does: real instruction sets have a long tail of long answers,
which is where padding wastes most and where best-fit packing has to work hardest. No data set
can be downloaded on the GPU machine (nor here), so the benchmark draws token sequences whose
lengths follow the shape of a published one.

Where the shape comes from: ShareGPT as tabulated in Wang et al., "How Far Can Camels Go?
Exploring the State of Instruction Tuning on Open Resources" (NeurIPS 2023 Datasets and
Benchmarks, arXiv:2306.04751), Table 1 (the statistics of the instruction data sets): average
prompt length 71.0 and average completion length 357.8 tokens per round (LLaMA tokenizer).
Those two means are the only published figures used. **They are not verified.** They were
written from memory in an offline session; on 2026-11-24 we searched the stored public pages,
documentation and code available to us (queries on the paper's title, its arXiv id, "ShareGPT"
with "average prompt/completion length", and the two numbers themselves) and found the paper's
abstract (NeurIPS proceedings page, OpenReview) and summaries of it, but no copy of Table 1, so
neither number (nor the 3.2 rounds per conversation we also recall) could be checked. A second search the
same day (Table 1 by its figures; ShareGPT length statistics in stored pages, docs and code; the
vLLM paper's ShareGPT workload, whose text gives only ratios to Alpaca) found none either. Treat the
long-tail draw as "a long tail with a mean near 430 tokens", and check Table 1 before quoting
the two means elsewhere. Everything else is our assumption, stated
as such: one example is one round (prompt + completion), its total length is log-normal with
that mean (428.8 tokens) and ``sigma`` 1.0 (a long right tail: median 260, about 8.5% of the
examples above 1,024 tokens, about 2% above 2,048), its prompt share is the published ratio
(71.0 / 428.8 = 16.6%, at least one token), and token ids are uniform over the vocabulary
(token identity does not change speed or memory). An example longer than the run's
``seq_len`` is cut by the packer's explicit ``truncate=True`` and counted in its stats, never
cut silently.

The draw depends only on ``seed`` (``random.Random``, not the global RNG).
"""

from __future__ import annotations

import math
import random
from typing import Any

__all__ = ["SHAREGPT_PROMPT_MEAN", "SHAREGPT_COMPLETION_MEAN", "LOGNORMAL_SIGMA", "long_tail_lengths",
           "long_tail_examples"]

#: Mean prompt / completion tokens per round of ShareGPT (Wang et al. 2023, Table 1, as recalled: not verified,
#: see the module docstring).
SHAREGPT_PROMPT_MEAN = 71.0
SHAREGPT_COMPLETION_MEAN = 357.8
#: Our assumption: the spread of the log-normal (not a published figure).
LOGNORMAL_SIGMA = 1.0
_IGNORE = -100


def long_tail_lengths(n: int, *, seed: int = 0, mean: float = SHAREGPT_PROMPT_MEAN + SHAREGPT_COMPLETION_MEAN,
                      sigma: float = LOGNORMAL_SIGMA, min_len: int = 8) -> list[int]:
    """``n`` example lengths, log-normal with the given ``mean`` and ``sigma``, at least ``min_len``.

    Raises:
        ValueError: ``n`` < 1, ``mean`` <= 0, ``sigma`` < 0 or ``min_len`` < 2.
    """
    if n < 1 or mean <= 0 or sigma < 0 or min_len < 2:
        raise ValueError(f"need n >= 1, mean > 0, sigma >= 0, min_len >= 2; got {n}, {mean}, {sigma}, {min_len}")
    rng = random.Random(seed)
    mu = math.log(mean) - sigma * sigma / 2  # the log-normal's mean is exp(mu + sigma^2 / 2)
    return [max(min_len, round(rng.lognormvariate(mu, sigma))) for _ in range(n)]


def long_tail_examples(n: int, vocab_size: int, *, seed: int = 0, special_ids: int = 3,
                       **length_kw: Any) -> list[dict[str, list[int]]]:
    """``n`` tokenized examples (``input_ids``, ``labels``) with :func:`long_tail_lengths`.

    Each example's first ``ceil(16.6%)`` tokens (the published prompt share, at least one) are
    the prompt, masked out of the loss (``-100``), like :func:`qlora_nb_utils.data.tokenize_examples`
    masks a prompt. Token ids are uniform in ``[special_ids, vocab_size)``.

    Raises:
        ValueError: ``vocab_size`` <= ``special_ids``, or bad length options.
    """
    if vocab_size <= special_ids:
        raise ValueError(f"vocab_size ({vocab_size}) must exceed special_ids ({special_ids})")
    share = SHAREGPT_PROMPT_MEAN / (SHAREGPT_PROMPT_MEAN + SHAREGPT_COMPLETION_MEAN)
    rng = random.Random(seed + 1)
    out = []
    for length in long_tail_lengths(n, seed=seed, **length_kw):
        ids = [rng.randrange(special_ids, vocab_size) for _ in range(length)]
        prompt = min(length - 1, max(1, math.ceil(share * length)))
        out.append({"input_ids": ids, "labels": [_IGNORE] * prompt + ids[prompt:], "length": length})
    return out
