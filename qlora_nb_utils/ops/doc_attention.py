"""Per-document causal attention for packed rows, built outside the compiled graph.

Why: a packed row (:mod:`qlora_nb_utils.data.packing`) holds several examples; each token may
attend only to earlier tokens of its own document. The mask must cost nothing where two
documents do not meet, and it must not break the graph or recompile from batch to batch.

**The path chosen: flex attention with a document-causal ``BlockMask`` made eagerly**
(:func:`document_block_mask`, :func:`with_document_mask`). The mask is built from the batch's
``document_ids`` before the compiled model is called, and passed as ``attention_mask``:
transformers 5.17 returns a 4-D mask or ``BlockMask`` as it is
(``masking_utils._preprocess_mask_arguments``, the first branch), so no mask code runs in the
graph, and ``flex_attention_forward`` hands the ``BlockMask`` to flex attention, which skips the
blocks where no query sees a key (across documents, above the diagonal). The ``mask_mod`` is a
closure over the ``document_ids`` tensor; Dynamo lifts that tensor as a graph input and guards
on the closure's code, not its identity. Measured on the tiny Llama (CPU, torch 2.13,
``fullgraph=True``, ``aot_eager``, forward: torch has no flex backward on a CPU): 0 graph
breaks and 1 compilation over batches with different document layouts
(``tests/test_packing.py``); with Inductor too (1 compilation over the same 3 layouts, 16 s for
the first call on 2 CPU cores, measured once, not in the tests).

**What transformers does by itself with packed ``position_ids``** (no ``attention_mask``):
``find_packed_sequence_indices`` derives document ids from the position resets; its early exit
for unpacked batches reads tensor data but is skipped while tracing, so it does not break.
With ``sdpa`` it then builds a dense ``(B, 1, S, S)`` boolean mask inside the graph: 0 breaks,
1 compilation, right logits (measured, tiny Llama, ``fullgraph=True``), but every block of the
mask is computed and attended, and SDPA cannot take its flash kernel with a mask. With
``flex_attention`` it calls ``create_block_mask(..., _compile=True)`` inside the graph, whose
deprecation ``warnings.warn`` is a graph break: 4 breaks on the 2-layer tiny model (measured),
so ``fullgraph=True`` fails. Hence the mask is built here, outside.

**The dense fallback** (:func:`document_dense_mask`, ``kernel="sdpa"``): the same mask as a 4-D
boolean tensor for SDPA. It is what trains on a CPU (flex has no CPU backward), and it is the
reference the flex path is tested against.

**Varlen**: ``torch.nn.attention.varlen.varlen_attn`` (and ``varlen_attn_out``) exists in
torch 2.13 (checked on the CPU build; :func:`varlen_available`). It takes cumulative sequence lengths instead of a mask and runs
on CUDA only; it is the other candidate for issue 19, to be measured on the GPU.

The model must run the kernel the mask is made for: :func:`use_document_attention` switches its
configs' ``_attn_implementation`` (read at trace time) and ``undo()`` switches them back; no
library code is patched. Train with ``use_cache=False``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..reversible import PatchHandle
from .attention import _configs

__all__ = ["DOC_MASK_KERNELS", "document_mask_mod", "document_block_mask", "document_dense_mask",
           "with_document_mask", "use_document_attention", "varlen_available"]

#: The attention implementations :func:`with_document_mask` can build a mask for.
DOC_MASK_KERNELS = ("flex_attention", "sdpa")


def _check_document_ids(document_ids: Any) -> None:
    if not isinstance(document_ids, torch.Tensor) or document_ids.dim() != 2:
        raise ValueError("document_ids must be a 2-D (rows, seq_len) tensor, got "
                         f"{getattr(document_ids, 'shape', type(document_ids).__name__)}")
    if document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
        raise ValueError(f"document_ids must be integers, got {document_ids.dtype}")


def _outside_compile(name: str) -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{name} runs outside the compiled graph: wrap the compiled model with "
                           "with_document_mask(torch.compile(model)), not the reverse")


def document_mask_mod(document_ids: torch.Tensor) -> Callable:
    """The flex ``mask_mod``: a query sees a key of its own document at or before it.

    Args:
        document_ids: ``(rows, seq_len)`` integers; equal ids are one document (the tail padding,
            ``-1``, is a segment of its own, so no query row is empty).
    """
    _check_document_ids(document_ids)

    def mask_mod(batch, head, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (document_ids[batch, q_idx] == document_ids[batch, kv_idx])

    return mask_mod


def document_block_mask(document_ids: torch.Tensor, block_size: int = 128):
    """The document-causal ``BlockMask`` of a packed batch, built eagerly.

    One mask per batch (``B=rows``, ``H=None``: broadcast over heads), on ``document_ids``'s
    device. Blocks where no query sees a key are left out, so flex attention skips them.

    Args:
        document_ids: ``(rows, seq_len)`` integers, as :func:`pack_examples` gives.
        block_size: the mask's block size (flex attention's default, 128).

    Returns:
        A ``torch.nn.attention.flex_attention.BlockMask`` of shape ``(rows, 1, seq_len, seq_len)``.

    Raises:
        ValueError: ``document_ids`` is not a 2-D integer tensor, or ``block_size`` < 1.
        RuntimeError: called while ``torch.compile`` traces.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    _outside_compile("document_block_mask")
    _check_document_ids(document_ids)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    rows, seq_len = document_ids.shape
    return create_block_mask(document_mask_mod(document_ids), B=rows, H=None, Q_LEN=seq_len, KV_LEN=seq_len,
                             device=document_ids.device, BLOCK_SIZE=block_size)


def document_dense_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The same mask as a ``(rows, 1, seq_len, seq_len)`` boolean tensor (True: attend), for SDPA.

    Raises:
        ValueError: ``document_ids`` is not a 2-D integer tensor.
    """
    _check_document_ids(document_ids)
    seq_len = document_ids.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


def with_document_mask(forward: Callable, kernel: str = "flex_attention", block_size: int = 128, *,
                       required: bool = True) -> Callable:
    """Wrap ``forward`` (a model or its compiled twin) to take packed batches.

    The wrapper pops the batch's ``document_ids``, builds the mask for ``kernel`` outside
    ``forward`` (:func:`document_block_mask` or :func:`document_dense_mask`) and passes it as
    ``attention_mask``; ``input_ids``, ``position_ids`` and ``labels`` pass through. The model
    must have been loaded with ``attn_implementation=kernel``. With ``required=False`` a batch
    without ``document_ids`` passes through untouched (a Trainer's padded evaluation batch, say).

    Raises:
        ValueError: ``kernel`` not in :data:`DOC_MASK_KERNELS`; when called: no ``document_ids``
            (with ``required``), or a packed batch that already has an ``attention_mask``.
    """
    if kernel not in DOC_MASK_KERNELS:
        raise ValueError(f"kernel must be one of {DOC_MASK_KERNELS}, got {kernel!r}")

    def run(*args, **batch):
        docs = batch.pop("document_ids", None)
        if docs is None:
            if not required:
                return forward(*args, **batch)
            raise ValueError("with_document_mask needs document_ids (keyword), as pack_examples gives")
        if batch.get("attention_mask") is not None:
            raise ValueError("a packed batch takes its mask from document_ids; drop attention_mask")
        if kernel == "flex_attention":
            batch["attention_mask"] = document_block_mask(docs, block_size)
        else:
            batch["attention_mask"] = document_dense_mask(docs)
        return forward(*args, **batch)

    return run


def use_document_attention(model: torch.nn.Module, kernel: str) -> PatchHandle:
    """Make ``model`` (a transformers causal LM, PEFT-wrapped or not) attend with ``kernel``.

    Sets ``_attn_implementation`` on every config its modules hold, so that the mask
    :func:`with_document_mask` builds for ``kernel`` reaches a kernel that takes it; ``undo()``
    puts the previous values back. Call it before compiling (the name is read at trace time).

    Raises:
        ValueError: ``kernel`` not in :data:`DOC_MASK_KERNELS`, or no transformers config.
    """
    if kernel not in DOC_MASK_KERNELS:
        raise ValueError(f"kernel must be one of {DOC_MASK_KERNELS}, got {kernel!r}")
    configs = _configs(model)
    if not configs:
        raise ValueError(f"{type(model).__name__} holds no transformers config with an attention implementation")
    handle = PatchHandle("document_attention", {"configs": len(configs), "implementation": kernel})
    for cfg in configs:
        old = cfg._attn_implementation  # a property: restore by setting the old value
        cfg._attn_implementation = kernel
        handle.add_undo(lambda cfg=cfg, old=old: setattr(cfg, "_attn_implementation", old))
    return handle


def varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn`` (True on torch 2.13)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True
