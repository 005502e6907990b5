"""The data a run trains on: loading, tokenizing, padding and batching.

- ``examples``: the shipped prompt/response JSONL (``default_data_path``) or the user's own
  data (prompt/response, prompt/completion or chat ``messages`` JSONL, or a ``save_to_disk``
  folder), validated line by line before any model loads (``validate_file``,
  ``validate_source``, ``DataFormatError`` naming the file and line), loaded with ``datasets``
  (``load_examples``; ``load_splits`` for training plus held-out examples), rendered with the
  chat template (``format_example``).
- ``tokenizing``: token rows with the prompt masked out of the loss (``tokenize_examples``,
  ``learned_rows``).
- ``token_cache``: tokenized rows kept on disk, keyed by what they depend on, so that a restart
  does not tokenize the same data again (``tokenize_examples(cache=True)``).
- ``batch_cache``: a run's finished batches kept on disk, keyed by the source files, the
  tokenizer, the arguments and the code, so that an unchanged start reads them back without
  loading the examples (``training.build_finetune_batches(cache=True)``).
- ``collate``: the padding policy that decides batch shapes under ``torch.compile``
  (``PaddingCollator``: ``longest``, ``multiple`` or ``fixed``), a seeded ``DataLoader``
  (``make_batches``) and what the padding costs (``padding_stats``).
- ``batches``: the one builder every caller uses (``build_batches``; ``build_packed_batches``
  for an epoch packed), real text cut to any
  length (``make_length_batcher``) and greedy packing (``pack_rows``).
- ``packing``: padding-free batches: whole examples packed best-fit decreasing into rows of one
  fixed length, with positions restarting and document ids per token (``pack_examples``,
  ``collate_packed``, ``best_fit_bins``, ``PackingStats``, ``PAD_DOCUMENT``), and the one way
  every run counts real (non-pad) tokens (``real_tokens``).

Importing it is cheap: torch and datasets are imported by the functions that need them.
"""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    **{name: "examples" for name in (
        "SPLITS", "FILE_TEMPLATE", "PADDING_POLICIES", "IGNORE_INDEX", "REQUIRED_FIELDS",
        "OPTIONAL_STR_FIELDS", "CHAT_ROLES", "HELDOUT_SPLITS", "DataFormatError", "MAX_REPORTED_PROBLEMS", "default_data_path",
        "validate_file", "validate_source", "load_examples", "load_splits", "format_example")},
    **{name: "tokenizing" for name in ("tokenize_examples", "learned_rows")},
    **{name: "collate" for name in ("PaddingCollator", "make_batches", "padding_stats")},
    **{name: "batches" for name in ("build_batches", "build_packed_batches", "pack_tokenized", "cut_tokenized", "UNCUT",
                                    "make_length_batcher", "pack_rows")},
    **{name: "packing" for name in ("pack_examples", "collate_packed", "best_fit_bins", "PackingStats",
                                    "PAD_DOCUMENT", "real_tokens")},
})
