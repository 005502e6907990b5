"""Reversible workarounds for upstream code that ``torch.compile`` cannot trace.

One module per upstream target; each exposes ``VERIFIED_ON``, ``SUPPORTED``,
``apply(model=None) -> PatchHandle`` (whose ``undo()`` restores exactly, and is safe twice)
and a ``patched(...)`` context manager. Importing this package patches nothing.

* :mod:`.input_require_grads`: transformers' ``enable_input_require_grads`` forward hook
  (``output.requires_grad_(True)``), which breaks the graph whenever gradient checkpointing
  is on.
* :mod:`.use_cache_warning`: the ``logger.warning_once`` that transformers emits when a
  checkpointing model is called with ``config.use_cache=True``.

Not a graph-break workaround, so not in :data:`PATCHES` (what ``prepare_for_compile`` applies):
:mod:`.bnb_cpu_packing` keeps bitsandbytes from repacking NF4 weights on a CPU eval pass, after
which training loses gradients; ``training.evaluation`` and ``training.finetuning`` apply it.
:mod:`.nf4_dequant` (a speed change, applied by ``optimize()`` on CUDA) routes bitsandbytes' NF4
``matmul_4bit`` / ``dequantize_4bit`` to the one-pass op of ``ops.nf4_triton``.
:mod:`.lora_addmm` (a memory change, applied by ``optimize()``) adds each LoRA update into its
base output with one ``addmm``, on the model's PEFT LoRA layers. :mod:`.tiled_mlp` (a memory change
for long sequences, applied by hand for now) runs each layer's MLP in checkpointed pieces along the
sequence.
"""

from ...reversible import PatchHandle
from . import input_require_grads, lora_addmm, nf4_dequant, tiled_mlp, use_cache_warning

#: Every patch, by name (the names ``compile.prepare_for_compile(patches=...)`` accepts).
PATCHES = {
    "input_require_grads": input_require_grads,
    "use_cache_warning": use_cache_warning,
}

__all__ = ["PATCHES", "PatchHandle", "input_require_grads", "lora_addmm", "nf4_dequant", "tiled_mlp",
           "use_cache_warning"]
