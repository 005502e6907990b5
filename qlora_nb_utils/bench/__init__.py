"""The lab: what measures the product. Nothing in the product imports it.

- ``main_job``: ``qlora-nb bench``, HF eager, plain compile and ``optimize()`` on the same
  batches, with parity against the eager floor (``run_bench``, ``validate_options``,
  ``write_results``, ``markdown_table``, ``make_bench_batches``).
- ``pairwise``: eager against compiled on the same batches, the notebooks' building blocks
  (``side_by_side``, ``compiled_run``, ``compare``), and the shape helpers of variable-length
  runs (``mark_dynamic``, ``warm_shapes``: a GPU's first step at a new length costs ~100 ms more).
- ``peers/``: ours against HF eager, plain compile, TRL, torchao NF4 and Unsloth, one process
  per library (``run_peer``, ``run_peers``, ``pick_ours``); our own recipe is product code
  (``qlora_nb_utils.compile.recipe``), the peer ``ours`` only loads, applies and records it.
- ``matrix``: {base, LoRA, QLoRA} x checkpointing x lengths x scope, eager vs compiled
  (``run_matrix``), ``python -m qlora_nb_utils.bench.matrix``; ``matrix_results`` reads its
  files without torch (``merge_results``, ``summary_frame``, ``parity_table``, ``config_lr``,
  ``markdown_table``), and ``matrix`` re-exports those names.
- ``compile_time``: cold, regional, cached and artifact starts, each in a new process.
- ``optim_bench``: the AdamW step eager (foreach, fused) against compiled.
- ``flops``: model FLOPs of a (Q)LoRA step, the measured matmul rate, MFU.
- ``profile``: where a step's time and memory go: kernel time grouped by kind (dequantize,
  base/LoRA matmuls, attention, norms/RoPE/activations, loss, optimizer, other) and what is
  alive at the memory peak (``profile_training``, ``classify_kernel``, ``memory_breakdown``).

This ``__init__`` imports nothing heavy: ``python -m qlora_nb_utils.bench.peers.unsloth``
must reach ``import unsloth`` before transformers is loaded.
"""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    **dict.fromkeys(("run_bench", "write_results", "markdown_table", "make_bench_batches", "resolve_device_dtype",
                     "DEFAULTS", "RUNS", "validate_options"), "main_job"),
    **dict.fromkeys(("side_by_side", "compiled_run", "compare", "mark_dynamic", "warm_shapes"), "pairwise"),
    **dict.fromkeys(("profile_training", "classify_kernel", "group_kernels", "memory_breakdown", "phase_marker"),
                    "profile"),
})
