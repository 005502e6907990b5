"""How much GPU memory a fast-path training step will need, before it runs.

Why this module exists: ``optimize(max_memory_gib=...)`` has to pick how many decoder layers
to checkpoint *before* the first step, so it needs a peak it can compute from the model and the
batch shape. The terms are counted from the model (weights as they will be after the recipe's
cast, LoRA gradients and AdamW state), and the activation terms are calibrated on measured
peaks (the lab's memory-target runs, 0 to every layer checkpointed at two token counts) against
the peak *reserved* memory, which under CUDA graphs is what the device must hold:

* an un-checkpointed layer saves a fitted number of ``hidden`` and ``intermediate`` elements
  per token (:data:`_ACT_PER_TOKEN`);
* a checkpointed one keeps its input (``hidden`` per token), and once any layer is checkpointed
  the backward holds one recomputed layer and its gradients at a time
  (:data:`_CKPT_TRANSIENT_LAYERS` layers' worth);
* the chunked loss holds a multiple of one chunk's logits in fp32 + its compute-dtype copy
  (:data:`_LOGITS_FACTOR`);
* a fixed allowance (:data:`_OVERHEAD_GIB`: workspace, CUDA-graph pool slack, allocator
  rounding) puts every calibration peak under its estimate.

With ``optimize(recompute=...)`` on, the backward recomputes the SwiGLU product and the three
LoRA inputs of hidden size (the two norm outputs, the attention output in token-major layout)
instead of saving them: counted on the CPU (``diagnostics.saved_for_backward``, the test in
``tests/test_recompute.py``), one intermediate-sized and three hidden-sized tensors per token
fewer, which the un-checkpointed layer's term subtracts from the fitted numbers
(:data:`_ACT_RECOMPUTED`). That is counted, not fitted on a measured peak.

With the LoRA updates added into the base outputs in place (``optimize(lora_addmm=...)``,
:mod:`qlora_nb_utils.ops.lora_update`), the peak grew by one intermediate-sized tensor, with
checkpointing off and on alike, so once, not per layer: ``lora_in_place_gib``, one
``tokens x intermediate`` tensor. Seen on one shape, not fitted.

With the checkpointed inputs offloaded to CPU memory (:mod:`.offload`), a checkpointed layer
keeps nothing on the GPU, and the backward holds at most two inputs copied back (the one in use
and the one prefetched): ``offload_transient_gib``. That term is counted, not fitted: no
measured offload peak has calibrated it. The pinned CPU memory it takes instead is
``ckpt_layers * kept_per_layer_gib``.

With each MLP run in pieces along the sequence (``compile.patches.tiled_mlp``), the recomputed
layer holds one piece's share of the intermediate-sized activations (and of the in-place LoRA
update's tensor) instead of the whole sequence's; counted, not fitted.

One model at two token counts fitted four numbers, so it is an estimate for choosing, not a
measurement: the run's ``peak_mem_gib`` is the fact. :func:`estimate_terms` gives the terms
apart, so the calibration script can refit them.
"""

from __future__ import annotations

from typing import Any

import torch

from .checkpointing import decoder_layers

__all__ = ["estimate_terms", "estimate_peak_gib"]

_GIB = 2**30
_ACT_PER_TOKEN = (6.93, 2.89)  # x hidden, x intermediate: elements saved per token by one un-checkpointed layer
_ACT_RECOMPUTED = (3.0, 1.0)  # x hidden, x intermediate: elements per token no longer saved with recompute
_CKPT_TRANSIENT_LAYERS = 1.64  # with checkpointing: one recomputed layer and its backward, in layers
_LOGITS_FACTOR = 1.90  # the chunked loss's transient, in (one chunk of logits, fp32 + compute dtype)
_OVERHEAD_GIB = 0.55  # workspace, CUDA-graph pool slack, allocator rounding
_OFFLOAD_RELOADED = 2  # offloaded inputs back on the GPU at once: the one in use, the one prefetched


def _config_of(model: torch.nn.Module) -> Any:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(inner, "config", None)


def estimate_terms(model: torch.nn.Module, batch_size: int, seq_len: int, *, ce_chunks: int = 4,
                   act_bytes: int = 2, cast_dtype: torch.dtype | None = None,
                   head_rows: int | None = None, recompute: bool = False,
                   lora_in_place: bool = False) -> dict[str, Any]:
    """The estimate's terms in GiB (and the shape numbers they come from).

    Args:
        model: the PEFT model, as handed to ``optimize()``.
        batch_size: rows per batch.
        seq_len: the (padded) length.
        ce_chunks: the chunked loss's pieces (0: the model's own loss, counted as one piece).
        act_bytes: bytes per element of the compute dtype.
        cast_dtype: the dtype the recipe will cast the non-LoRA float weights to (None: as they are).
        head_rows: the rows the LM head and loss run over (``optimize(loss_rows=...)``: the
            largest bucketed count of labelled rows shown); None: every token.
        recompute: the backward recomputes elementwise results (``optimize(recompute=...)``).
        lora_in_place: the LoRA updates are added into the base outputs in place
            (``optimize(lora_addmm=...)``): one more intermediate-sized tensor at the peak.
    """
    config = _config_of(model)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    tokens = batch_size * seq_len
    static = 0
    for name, p in model.named_parameters():
        size = p.element_size()
        if cast_dtype is not None and p.is_floating_point() and "lora_" not in name:
            size = torch.finfo(cast_dtype).bits // 8
        static += p.numel() * size
    static += sum(b.numel() * b.element_size() for b in model.buffers())
    static += sum(p.numel() for p in model.parameters() if p.requires_grad) * 12  # fp32 grad + AdamW moments
    per_h, per_i = _ACT_PER_TOKEN
    if recompute:
        per_h, per_i = per_h - _ACT_RECOMPUTED[0], per_i - _ACT_RECOMPUTED[1]
    per_layer = tokens * (per_h * hidden + per_i * inter) * act_bytes / _GIB
    per_layer_intermediate = tokens * per_i * inter * act_bytes / _GIB  # the MLP's share, what tiles shrink
    return {"layers": len(decoder_layers(model)), "tokens": tokens, "seq_len": seq_len, "hidden": hidden,
            "intermediate": inter,
            "vocab": vocab, "act_bytes": act_bytes, "static_gib": static / _GIB, "per_layer_gib": per_layer,
            "per_layer_intermediate_gib": per_layer_intermediate,
            "kept_per_layer_gib": tokens * hidden * act_bytes / _GIB,
            "ckpt_transient_gib": _CKPT_TRANSIENT_LAYERS * per_layer,
            "offload_transient_gib": _OFFLOAD_RELOADED * tokens * hidden * act_bytes / _GIB,
            "logits_gib": _LOGITS_FACTOR * (tokens if head_rows is None else min(head_rows, tokens))
            / max(ce_chunks, 1) * vocab * (act_bytes + 8) / _GIB,
            "lora_in_place_gib": tokens * inter * act_bytes / _GIB if lora_in_place else 0.0,
            "overhead_gib": _OVERHEAD_GIB}


def peak_from_terms(terms: dict[str, Any], ckpt_layers: int, offload: bool = False,
                    tile_rows: int | None = None) -> float:
    """The estimated peak (GiB) with the first ``ckpt_layers`` layers checkpointed (their inputs
    offloaded to CPU memory with ``offload``), each MLP run in pieces of ``tile_rows`` positions
    (``compile.patches.tiled_mlp``) when given.

    With every layer checkpointed, the tiles shrink what the recomputed layer holds of its MLP
    (the intermediate-sized share of the layer's activations, and the in-place LoRA update's
    tensor) to one piece's worth; an un-checkpointed layer still saves every piece's."""
    n = max(0, min(ckpt_layers, terms["layers"]))
    kept = terms["offload_transient_gib"] if offload and n else n * terms["kept_per_layer_gib"]
    share = 1.0 if not tile_rows else min(1.0, tile_rows / max(terms["seq_len"], 1))  # pieces along the sequence
    per_i = terms.get("per_layer_intermediate_gib", 0.0)
    transient = terms["ckpt_transient_gib"] - (1 - share) * _CKPT_TRANSIENT_LAYERS * per_i
    return (terms["static_gib"] + kept + (terms["layers"] - n) * terms["per_layer_gib"]
            + (transient if n else 0.0) + terms["logits_gib"] + terms["overhead_gib"]
            + terms.get("lora_in_place_gib", 0.0) * share)


def estimate_peak_gib(model: torch.nn.Module, batch_size: int, seq_len: int, ckpt_layers: int, *,
                      ce_chunks: int = 4, act_bytes: int = 2, cast_dtype: torch.dtype | None = None,
                      offload: bool = False, recompute: bool = False, lora_in_place: bool = False) -> float:
    """A training-step peak (GiB) of the fast path on a CUDA device (see the module docstring)."""
    terms = estimate_terms(model, batch_size, seq_len, ce_chunks=ce_chunks, act_bytes=act_bytes,
                           cast_dtype=cast_dtype, recompute=recompute, lora_in_place=lora_in_place)
    return peak_from_terms(terms, ckpt_layers, offload)
