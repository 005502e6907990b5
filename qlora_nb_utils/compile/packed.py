"""Packed batches in :func:`~qlora_nb_utils.compile.fast_path.optimize`: what it decides and wraps.

Why this module exists: a packed batch (:func:`qlora_nb_utils.data.pack_examples`) has one fixed
shape and almost no padding, but it trains correctly only if every token attends to its own
document alone. ``optimize()`` recognises packed batches by their ``document_ids`` and then
needs three things that padded batches do not: a kernel that takes a per-document mask, the
model switched to that kernel (reversibly), and the mask built from each batch's
``document_ids`` *outside* the compiled graph, so that building it can neither break the graph
nor recompile (:mod:`qlora_nb_utils.ops.doc_attention` says why inside the graph fails). They
live here so that ``fast_path`` stays one page of choices.

The kernel (``doc_attention="auto"``, chosen by :func:`.choices.choose_doc_kernel`): flex attention with a document-causal ``BlockMask`` on
CUDA (blocks where two documents do not meet are skipped), the dense boolean mask with SDPA
elsewhere (torch has no flex-attention backward on a CPU). Either can be asked for. A model whose
attention changes its scores in a way SDPA drops (Gemma-2's soft cap) keeps it: flex attention's
score modification on CUDA, the model's own eager attention with an additive document mask elsewhere.

Flex and SDPA train packed batches alike (one compilation over the epoch, within the bf16
floor). ``"varlen"`` (torch's ``varlen_attn``, :mod:`qlora_nb_utils.ops.doc_attention`) trains
the same batches faster and with a lower peak, in one compilation, without graph breaks and
within its eager floor. **"auto" stays flex attention for now**: the comparison with flex was
not made within one run, varlen has not run at the largest shape, and callers outside this
module (``bench.packing_job``'s graph-break count, notebook 08) still build flex's mask or
assert flex on CUDA. Ask for ``doc_attention="varlen"`` to use it.
"""

from __future__ import annotations

from typing import Sequence

from ..ops.doc_attention import DOC_MASK_KERNELS

__all__ = ["DOC_ATTENTION", "packed_batches"]

#: What ``optimize(doc_attention=...)`` accepts.
DOC_ATTENTION = ("auto",) + DOC_MASK_KERNELS


def packed_batches(batches: Sequence[dict] | None) -> bool:
    """Whether the batches shown are packed (each has ``document_ids``).

    Raises:
        ValueError: some batches are packed and others not (one run trains one kind), or a
            packed batch has an ``attention_mask`` or lacks ``position_ids``.
    """
    if not batches:
        return False
    flags = ["document_ids" in b for b in batches]
    if not any(flags):
        return False
    if not all(flags):
        raise ValueError(f"{flags.count(True)} of {len(flags)} batches are packed (have document_ids): "
                         "train on packed or on padded batches, not both")
    for i, batch in enumerate(batches):
        if batch.get("attention_mask") is not None:
            raise ValueError(f"packed batch {i} has an attention_mask: a packed batch takes its mask from "
                             "document_ids (drop attention_mask)")
        if batch.get("position_ids") is None:
            raise ValueError(f"packed batch {i} has no position_ids: positions must restart at every document "
                             "(pack with data.pack_examples)")
    return True


