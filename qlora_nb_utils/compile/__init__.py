"""Make a (Q)LoRA model train under ``torch.compile``: few graphs, no breaks, eager's memory.

"Call ``torch.compile(model)``" is one line, but a QLoRA training step only compiles into few
graphs with zero breaks, and keeps checkpointing's memory saving, when a few decisions are
made together: which upstream code to patch, which checkpointing variant and recompute policy,
what to compile (the whole model or each decoder layer), how to compile the optimizer step, and
whether to keep eager's low-precision rounding. This subpackage makes those decisions,
reversibly, and counts every compilation it causes. :mod:`.prepare`'s docstring gives the
reasoning behind each.

Entry points (imported lazily, on first use; importing the subpackage imports no torch):

* :func:`prepare_for_compile` -> :class:`Prepared`, in :mod:`.prepare`: patch, configure and
  compile a model, undoably; :func:`valid_modes`, :func:`valid_backends`, ``SCOPES`` and
  ``GRAD_CKPT_CHOICES`` name the options it accepts.
* :func:`must_recompute_context` and :func:`decoder_layers`, in :mod:`.checkpointing`: the
  recompute policy the compiler must obey, and the layers that are checkpointed and compiled.
* :func:`compiled_optimizer` and :class:`CompiledOptimizer`, in :mod:`.optimizer`: an
  optimizer step compiled so that LR schedulers do not recompile it.
* :class:`CompileCounter`, in :mod:`.counting`: what was compiled, recompiled and why
  (``diagnostics`` re-exports it).
* :func:`prepare_fast` -> :class:`FastPrepared`, in :mod:`.recipe`: the fastest recipe this
  project has measured, as plain functions (``cast_non_lora``, causal-only SDPA, the chunked
  loss, checkpointing on the first N layers, ``autocast_forward``,
  ``activation_memory_budget``); ``docs/fast_recipe.md`` shows it and its figures.
* :mod:`.patches`: the reversible workarounds for upstream code Dynamo cannot trace.

* :func:`optimize` -> :class:`Optimized`, in :mod:`.fast_path`: the entry point a user starts
  from. It applies the recipe and makes the choices it can from the device and the batches
  (CUDA graphs, dynamic lengths, the attention path, how many layers to checkpoint for a
  memory target), and says what it chose; the names above are its building blocks.
  :mod:`.memory_estimate` (``estimate_peak_gib``) is the peak it plans by: an upper bound counted from the config.
* :class:`OptimizeOptions` (``optimize()``'s knobs, validated, from keywords or a dict; what the
  CLI, the trainers and the benchmarks build and check) and :class:`RecipeOptions` (what
  ``prepare_fast`` applies), in :mod:`.options`; each choice that turns ``"auto"`` into a
  decision is a small function of :mod:`.choices`, run in order by :func:`.plan.decide`.
* :class:`StepInputs`, in :mod:`.step_inputs`: everything the step needs besides the batch
  (padding, labelled rows, masks, the compile's settings, the ``RecipeOptions`` inside), one
  object for the compiled step and for ``Optimized.inputs``.
* :class:`CpuOffloader`, in :mod:`.offload`: checkpointed layers' saved inputs kept in pinned
  CPU memory, copied on a side stream (``optimize(offload=...)``; ``offload.apply(model)``).
"""

from .._lazy import lazy_exports

#: Public name -> the module under this package that defines it.
_EXPORTS = {
    **dict.fromkeys((
        "prepare_for_compile", "Prepared", "valid_modes", "valid_backends", "SCOPES",
        "GRAD_CKPT_CHOICES",
    ), "prepare"),
    **dict.fromkeys(("must_recompute_context", "decoder_layers"), "checkpointing"),
    **dict.fromkeys(("CompiledOptimizer", "compiled_optimizer"), "optimizer"),
    **dict.fromkeys(("CompileCounter",), "counting"),
    **dict.fromkeys((
        "prepare_fast", "FastPrepared", "cast_non_lora", "checkpoint_first_layers",
        "autocast_forward", "activation_memory_budget",
    ), "recipe"),
    **dict.fromkeys(("optimize", "Optimized"), "fast_path"),
    **dict.fromkeys(("OptimizeOptions", "RecipeOptions"), "options"),
    **dict.fromkeys(("pad_batch", "StepInputs"), "step_inputs"),
    **dict.fromkeys(("estimate_peak_gib", "estimate_terms"), "memory_estimate"),
    **dict.fromkeys(("CpuOffloader", "OffloadStats"), "offload"),
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
