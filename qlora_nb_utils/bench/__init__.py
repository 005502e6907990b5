"""Measuring a run of your own: eager against compiled on the same batches, judged against the
eager floor, and what the compile costs.

- ``main_job``: ``qlora-nb bench``, HF eager, plain compile and ``optimize()`` on the same
  batches, with parity against the eager floor (``run_bench``, ``validate_options``,
  ``write_results``, ``markdown_table``, ``make_bench_batches``); ``packing_job`` is its packed
  variant.
- ``pairwise``: eager against compiled on the same batches, the notebooks' building blocks
  (``side_by_side``, ``compiled_run`` and ``CompiledRun``, ``compare``), and the shape helpers of variable-length
  runs (``mark_dynamic``, ``warm_shapes``).
- ``matrix``: {base, LoRA, QLoRA} x checkpointing x lengths x scope, eager vs compiled
  (``run_matrix``); ``matrix_results`` reads its files without torch.
- ``compile_time``: cold, regional, cached and artifact starts, each in a new process.
- ``flops``: model FLOPs of a (Q)LoRA step, the measured matmul rate, MFU.
- ``markdown``: the one table-header helper every Markdown table uses.

What measures the product against other libraries (peers, profiles, the GPU scripts and their
results) is the repository's lab, beside this package; nothing here imports it.
"""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    **dict.fromkeys(("run_bench", "write_results", "markdown_table", "make_bench_batches", "resolve_device_dtype",
                     "DEFAULTS", "RUNS", "validate_options"), "main_job"),
    **dict.fromkeys(("side_by_side", "CompiledRun", "compiled_run", "compare", "mark_dynamic", "warm_shapes"), "pairwise"),
})
