"""Code that computes, each piece testable on its own against a reference.

- ``nf4``: an NF4 dequantize as a ``torch.library.custom_op`` with a fake kernel
  (``dequantize_nf4``), checked with ``torch.library.opcheck``.
- ``losses``: linear + cross-entropy in chunks that never holds the full fp32 logits
  (``chunked_cross_entropy``, ``ChunkedLossLM``), and its per-token form for trainers that
  reduce the loss themselves (``chunked_token_log_probs``).
- ``attention``: causal-only SDPA and flex attention for right-padded training batches,
  registered through transformers' ``AttentionInterface`` and reversible
  (``use_causal_sdpa``, ``use_causal_flex``, ``use_causal_attention``, ``causal_block_mask``).
- ``doc_attention``: per-document causal attention for packed rows, the mask built outside the
  compiled graph (``document_block_mask`` for flex, ``document_dense_mask`` for SDPA,
  ``with_document_mask``, ``document_mask_mod``, ``varlen_available``).
- ``model_attention``: a model whose attention changes its scores in a way SDPA drops (Gemma-2's
  soft cap) keeps it when compiled: flex attention with the change in its score modification,
  causal block masks per sliding window built outside the graph (``use_attention``,
  ``with_block_masks``, ``FLEX_SCORES``).
- ``lora_update``: a LoRA update added into the base layer's output in place (``add_lora_``,
  the mutable custom op ``qlora_nb::lora_addmm_``), with no copy of the base output; and a whole
  LoRA linear over an NF4 base whose base matmul adds into the update (``nf4_lora_linear``).
- ``static_floats``: a function compiled with dynamic shapes whose Python floats stay constants, so
  a cold compile traces it once (``with_static_floats``; the regional layers and the chunked loss).

Nothing here imports the rest of the package except ``reversible`` (the undo handle) and
``models.attention_scores`` (what a model's attention does, read on a probe forward).
"""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "dequantize_nf4": "nf4",
    "chunked_cross_entropy": "losses",
    "ChunkedLossLM": "losses",
    "chunked_token_log_probs": "losses",
    "TokenStats": "losses",
    "use_causal_sdpa": "attention",
    "use_causal_flex": "attention",
    "use_causal_attention": "attention",
    "causal_block_mask": "attention",
    "check_right_padded": "attention",
    **{name: "model_attention" for name in ("use_attention", "with_block_masks", "FLEX_SCORES")},
    "add_lora_": "lora_update",
    "nf4_lora_linear": "lora_update",
    **{name: "doc_attention" for name in ("DOC_MASK_KERNELS", "document_mask_mod", "document_block_mask",
                                          "document_dense_mask", "with_document_mask", "varlen_available")},
})
