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
on the closure's code, not its identity. So batches with different document layouts compile
once, without graph breaks, under ``fullgraph=True`` (``tests/test_packing.py`` checks it on the
tiny Llama with ``aot_eager``, forward only: torch has no flex backward on a CPU; Inductor keeps
the single compilation too, though its first call is slow on a CPU).

**What transformers does by itself with packed ``position_ids``** (no ``attention_mask``):
``find_packed_sequence_indices`` derives document ids from the position resets; its early exit
for unpacked batches reads tensor data but is skipped while tracing, so it does not break.
With ``sdpa`` it then builds a dense ``(B, 1, S, S)`` boolean mask inside the graph: no
breaks, no recompiles and the right logits under ``fullgraph=True``, but every block of the
mask is computed and attended, and SDPA cannot take its flash kernel with a mask. With
``flex_attention`` it calls ``create_block_mask(..., _compile=True)`` inside the graph, whose
deprecation ``warnings.warn`` is a graph break in every layer, so ``fullgraph=True`` fails.
Hence the mask is built here, outside.

**The dense fallback** (:func:`document_dense_mask`, ``kernel="sdpa"``): the same mask as a 4-D
boolean tensor for SDPA. It is what trains on a CPU (flex has no CPU backward), and it is the
reference the flex path is tested against. For a model whose attention changes its scores in a
way SDPA drops (Gemma-2's soft cap, :mod:`.model_attention`), ``kernel="eager"`` gives the same
mask as an additive one (:func:`document_additive_mask`) to the model's own eager attention.

**Varlen** (``kernel="varlen"``, :func:`document_cu_seqlens`): torch's own
``torch.nn.attention.varlen.varlen_attn`` (flash attention over cumulative sequence lengths,
CUDA only; present on torch 2.11 and 2.13, :func:`varlen_available`). The packed batch is one
flat sequence of ``rows x seq_len`` tokens cut at every document start and every row start;
:func:`with_document_mask` builds those cuts outside the graph and passes them as transformers'
own padding-free keywords (``cu_seq_lens_q/k``, ``max_length_q/k``), which reach the attention
function of every layer. Two things keep it to one compilation: ``max_length`` is always
``seq_len`` (a bound, so the kernel's grid never follows the data), and the cuts are padded to a
power of two (at least 16) with the total, zero-length sequences the kernel skips, the tensor's
length marked dynamic. The implementation is registered with transformers' ``AttentionInterface``
under :data:`VARLEN` and not with the mask interface, so transformers builds no mask at all. On a
CPU the same cuts drive the dense mask and SDPA (the reference the CUDA kernel is tested
against; the flash kernel has no CPU build). On a GPU it trains a whole epoch of packed rows
under ``fullgraph=True`` with one compilation and no graph breaks, faster and in less memory than
flex attention on the same rows (the lab's packing benchmark records the figures;
:mod:`qlora_nb_utils.compile.packed` says why flex stays the default).

The model must run the kernel the mask is made for: :func:`use_document_attention` switches its
configs' ``_attn_implementation`` (read at trace time) and ``undo()`` switches them back; no
library code is patched. Train with ``use_cache=False``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..reversible import PatchHandle
from .attention import model_configs

__all__ = ["DOC_MASK_KERNELS", "document_mask_mod", "document_block_mask", "document_dense_mask",
           "document_additive_mask",
           "with_document_mask", "use_document_attention", "varlen_available", "document_cu_seqlens",
           "document_attention_kwargs", "register_varlen", "VARLEN"]

#: The attention implementations :func:`with_document_mask` can build a mask (or cuts) for.
DOC_MASK_KERNELS = ("flex_attention", "sdpa", "varlen", "eager")
#: The name ``kernel="varlen"`` is registered under in transformers' ``AttentionInterface``.
VARLEN = "qlora_nb_varlen"
#: The fewest cut slots :func:`document_cu_seqlens` gives (then powers of two).
MIN_CUTS = 16


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


#: One buffer per (shape, dtype, device) for ``document_block_mask(stable_ids=True)``.
_STABLE_IDS: dict[tuple, torch.Tensor] = {}


def _stable_copy(document_ids: torch.Tensor) -> torch.Tensor:
    """``document_ids`` copied into the one buffer of its shape, dtype and device (the same address each call)."""
    key = (tuple(document_ids.shape), document_ids.dtype, document_ids.device)
    buf = _STABLE_IDS.get(key)
    if buf is None:
        buf = _STABLE_IDS[key] = torch.empty_like(document_ids)
    return buf.copy_(document_ids)


def _contiguous_segments(document_ids: torch.Tensor) -> torch.Tensor | None:
    """Each position's segment number along its row (0, 1, ...: a new one where the id changes),
    or None when an id comes back after another one (a segment then is not a document)."""
    change = torch.zeros_like(document_ids, dtype=torch.int32)
    change[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).to(torch.int32)
    segments = change.cumsum(dim=1, dtype=torch.int32)
    distinct = torch.tensor([int(torch.unique(row).numel()) for row in document_ids], device=document_ids.device)
    return segments if bool((segments[:, -1] + 1 == distinct).all()) else None


def _kv_blocks_from_segments(segments: torch.Tensor, block_size: int):
    """flex attention's block lists of the document-causal mask, from the segments' first and last
    number in each block: memory of order (seq_len / block_size)^2, never seq_len^2.

    A (query block i, key block j) pair is seen when j <= i and the key block's last segment
    reaches the query block's first; it is whole (no mask_mod call) when j < i and both blocks
    lie inside one segment; a seen pair that is not whole is partial.
    """
    rows, seq_len = segments.shape
    n = seq_len // block_size
    blocks = segments.view(rows, n, block_size)
    first, last = blocks[..., 0], blocks[..., -1]  # segments never decrease along a row
    i = torch.arange(n, device=segments.device)
    below = (i[None, :] <= i[:, None])[None]  # (1, q, kv): key block at or before the query block
    seen = below & (last[:, None, :] >= first[:, :, None])
    one = (first == last)
    whole = (i[None, :] < i[:, None])[None] & one[:, :, None] & one[:, None, :] & (first[:, :, None] == first[:, None, :])
    partial = seen & ~whole

    def lists(mask):
        count = mask.sum(dim=-1, dtype=torch.int32)
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # seen blocks first, in order
        return count[:, None], order[:, None]

    return (*lists(partial), *lists(whole))


def document_block_mask(document_ids: torch.Tensor, block_size: int = 128, *, stable_ids: bool = False):
    """The document-causal ``BlockMask`` of a packed batch, built eagerly.

    One mask per batch (``B=rows``, ``H=None``: broadcast over heads), on ``document_ids``'s
    device. Blocks where no query sees a key are left out, so flex attention skips them.

    Args:
        document_ids: ``(rows, seq_len)`` integers, as :func:`pack_examples` gives.
        block_size: the mask's block size (flex attention's default, 128).
        stable_ids: the ``mask_mod`` reads a copy of ``document_ids`` in one buffer reused by
            every call of the same shape (for CUDA graphs, which take the tensor a ``mask_mod``
            captures as a static input: recorded at its address, recorded again when a new
            batch's ids lie elsewhere, and each re-recording is a slow step). The mask of the
            previous call then reads the new ids: use it before building the next.

    Returns:
        A ``torch.nn.attention.flex_attention.BlockMask`` of shape ``(rows, 1, seq_len, seq_len)``.

    Raises:
        ValueError: ``document_ids`` is not a 2-D integer tensor, or ``block_size`` < 1.
        RuntimeError: called while ``torch.compile`` traces.
    """
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    _outside_compile("document_block_mask")
    _check_document_ids(document_ids)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    rows, seq_len = document_ids.shape
    if stable_ids:
        document_ids = _stable_copy(document_ids)
    mask_mod = document_mask_mod(document_ids)
    segments = _contiguous_segments(document_ids) if seq_len % block_size == 0 else None
    if segments is None:
        return create_block_mask(mask_mod, B=rows, H=None, Q_LEN=seq_len, KV_LEN=seq_len,
                                 device=document_ids.device, BLOCK_SIZE=block_size)
    kv_num, kv_idx, full_num, full_idx = _kv_blocks_from_segments(segments, block_size)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(seq_len, seq_len))


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


def document_additive_mask(document_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The same mask as a ``(rows, 1, seq_len, seq_len)`` additive mask (0: attend, the dtype's
    minimum: not), for a model's eager attention, which adds its mask to the scores after any
    change it makes to them (Gemma-2's soft cap), as transformers' own eager mask does.

    Raises:
        ValueError: ``document_ids`` is not a 2-D integer tensor, or ``dtype`` is not a float dtype.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"an additive mask needs a float dtype, got {dtype}")
    allowed = document_dense_mask(document_ids)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def with_document_mask(forward: Callable, kernel: str = "flex_attention", block_size: int = 128, *,
                       required: bool = True, stable_ids: bool = False) -> Callable:
    """Wrap ``forward`` (a model or its compiled twin) to take packed batches.

    The wrapper pops the batch's ``document_ids``, builds the mask (or the varlen cuts) for
    ``kernel`` outside ``forward`` (:func:`document_attention_kwargs`) and passes it on;
    ``input_ids``, ``position_ids`` and ``labels`` pass through. The model must attend with
    ``kernel`` (:func:`use_document_attention`). With ``required=False`` a batch
    without ``document_ids`` passes through untouched (a Trainer's padded evaluation batch, say).
    ``stable_ids``: the flex mask reads its ids from one reused buffer (for CUDA graphs; see
    :func:`document_block_mask`).

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
        batch.update(document_attention_kwargs(docs, kernel, block_size, stable_ids=stable_ids))
        return forward(*args, **batch)

    return run


def use_document_attention(model: torch.nn.Module, kernel: str) -> PatchHandle:
    """Make ``model`` (a transformers causal LM, PEFT-wrapped or not) attend with ``kernel``.

    Sets ``_attn_implementation`` on every config its modules hold, so that the mask
    :func:`with_document_mask` builds for ``kernel`` reaches a kernel that takes it (``"varlen"``:
    :data:`VARLEN`, registered once by :func:`register_varlen`); ``undo()`` puts the previous
    values back. Call it before compiling (the name is read at trace time).

    Raises:
        ValueError: ``kernel`` not in :data:`DOC_MASK_KERNELS`, or no transformers config.
    """
    if kernel not in DOC_MASK_KERNELS:
        raise ValueError(f"kernel must be one of {DOC_MASK_KERNELS}, got {kernel!r}")
    name = register_varlen() if kernel == "varlen" else kernel
    configs = model_configs(model)
    if not configs:
        raise ValueError(f"{type(model).__name__} holds no transformers config with an attention implementation")
    handle = PatchHandle("document_attention", {"configs": len(configs), "implementation": name})
    for cfg in configs:
        old = cfg._attn_implementation  # a property: restore by setting the old value
        cfg._attn_implementation = name
        handle.add_undo(lambda cfg=cfg, old=old: setattr(cfg, "_attn_implementation", old))
    return handle


def varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn`` (True on torch 2.11 and 2.13)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def document_cu_seqlens(document_ids: torch.Tensor, min_cuts: int = MIN_CUTS) -> torch.Tensor:
    """The varlen cuts of a packed batch: where each sequence starts in the flat ``rows x seq_len`` tokens.

    A sequence starts at every row start and wherever the document id changes (a row's tail
    padding, ``-1``, is a sequence of its own). The starts are followed by the total
    (``rows x seq_len``), repeated up to a power of two of at least ``min_cuts`` entries: the
    repeats are zero-length sequences that the kernel skips, so batches of different layouts
    share a few lengths, and the length is marked dynamic for ``torch.compile``.

    Args:
        document_ids: ``(rows, seq_len)`` integers, as :func:`pack_examples` gives.
        min_cuts: the fewest entries (a power of two keeps the lengths few).

    Returns:
        An ``int32`` tensor on ``document_ids``'s device, non-decreasing, from 0 to ``rows x seq_len``.

    Raises:
        ValueError: ``document_ids`` is not a 2-D integer tensor.
        RuntimeError: called while ``torch.compile`` traces (it reads the ids' values).
    """
    _outside_compile("document_cu_seqlens")
    _check_document_ids(document_ids)
    rows, seq_len = document_ids.shape
    flat = document_ids.reshape(-1)
    start = torch.ones_like(flat, dtype=torch.bool)
    start[1:] = flat[1:] != flat[:-1]
    start[::seq_len] = True
    starts = start.nonzero().flatten()
    size = max(int(min_cuts), 1 << int(starts.numel()).bit_length())  # > the starts: room for the total
    cuts = torch.full((size,), rows * seq_len, dtype=torch.int32, device=document_ids.device)
    cuts[:starts.numel()] = starts.to(torch.int32)
    torch._dynamo.maybe_mark_dynamic(cuts, 0)
    return cuts


def document_attention_kwargs(document_ids: torch.Tensor, kernel: str, block_size: int = 128, *,
                              stable_ids: bool = False) -> dict[str, Any]:
    """What the model takes besides the tokens to attend per document with ``kernel``, built eagerly.

    ``flex_attention``: ``attention_mask`` = :func:`document_block_mask`; ``sdpa``:
    ``attention_mask`` = :func:`document_dense_mask`; ``eager``: ``attention_mask`` =
    :func:`document_additive_mask`; ``varlen``: transformers' padding-free
    keywords ``cu_seq_lens_q``/``cu_seq_lens_k`` (:func:`document_cu_seqlens`) and
    ``max_length_q``/``max_length_k`` (``seq_len``, a fixed bound). ``stable_ids``: see
    :func:`document_block_mask` (flex attention only; the other kernels take plain inputs).

    Raises:
        ValueError: ``kernel`` not in :data:`DOC_MASK_KERNELS`, or bad ``document_ids``.
    """
    if kernel == "flex_attention":
        return {"attention_mask": document_block_mask(document_ids, block_size, stable_ids=stable_ids)}
    if kernel == "sdpa":
        return {"attention_mask": document_dense_mask(document_ids)}
    if kernel == "eager":
        return {"attention_mask": document_additive_mask(document_ids)}
    if kernel == "varlen":
        cuts = document_cu_seqlens(document_ids)
        seq_len = int(document_ids.shape[1])
        return {"cu_seq_lens_q": cuts, "cu_seq_lens_k": cuts, "max_length_q": seq_len, "max_length_k": seq_len}
    raise ValueError(f"kernel must be one of {DOC_MASK_KERNELS}, got {kernel!r}")


def _varlen_options() -> dict[str, bool]:
    """Which keywords this torch's ``varlen_attn`` takes (its signature changed between releases)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return {name: name in params for name in ("enable_gqa", "window_size", "is_causal", "scale")}


def _cut_mask(cuts: torch.Tensor, rows: int, seq_len: int) -> torch.Tensor:
    """The ``(rows, 1, seq_len, seq_len)`` document-causal mask the cuts describe (traceable)."""
    pos = torch.arange(rows * seq_len, device=cuts.device, dtype=cuts.dtype)
    seg = (torch.searchsorted(cuts, pos, right=True) - 1).view(rows, seq_len)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=cuts.device).tril()
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


def _make_varlen_attention(options: dict[str, bool] | None) -> Callable:
    """The attention function registered as :data:`VARLEN` (``options``: :func:`_varlen_options`; None: no varlen)."""

    def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        cuts, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        if cuts is None or max_len is None:
            raise ValueError("varlen attention needs cu_seq_lens_q and max_length_q: wrap the model with "
                             "with_document_mask(..., 'varlen'), which builds them from document_ids")
        if dropout:
            raise ValueError(f"varlen attention trains without attention dropout, got {dropout}")
        rows, heads, seq_len, dim = query.shape
        kv_heads = key.shape[1]
        if query.is_cuda and options is None:
            raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
        if not query.is_cuda:  # the same cuts as a dense mask: the CPU reference
            mask = _cut_mask(cuts, rows, seq_len)
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, scale=scaling, enable_gqa=heads != kv_heads)
            return out.transpose(1, 2).contiguous(), None
        from torch.nn.attention.varlen import varlen_attn

        q = query.transpose(1, 2).reshape(rows * seq_len, heads, dim)
        k = key.transpose(1, 2).reshape(rows * seq_len, kv_heads, dim)
        v = value.transpose(1, 2).reshape(rows * seq_len, kv_heads, dim)
        kw: dict[str, Any] = {}
        if heads != kv_heads:
            if options["enable_gqa"]:
                kw["enable_gqa"] = True
            else:  # an older signature: repeat the K/V heads
                k = k.repeat_interleave(heads // kv_heads, dim=1)
                v = v.repeat_interleave(heads // kv_heads, dim=1)
        if options["window_size"]:
            kw["window_size"] = (-1, 0)  # causal
        else:
            kw["is_causal"] = True
        if scaling is not None and options["scale"]:
            kw["scale"] = scaling
        elif scaling is not None:  # no scale keyword: the kernel's own 1/sqrt(dim), folded into q
            q = q * (scaling * dim ** 0.5)
        out = varlen_attn(q, k, v, cuts, cuts, max_len, max_len, **kw)
        return out.view(rows, seq_len, heads, dim), None

    return varlen_attention


def register_varlen() -> str:
    """Register :data:`VARLEN` with transformers' ``AttentionInterface`` (idempotent); return the name.

    Only the attention function is registered: with no mask function under that name,
    transformers skips building a mask. Without ``varlen_attn`` in this torch only the CPU
    reference (the dense mask from the same cuts) runs; CUDA tensors are refused.
    """
    from transformers import AttentionInterface

    options = _varlen_options() if varlen_available() else None
    AttentionInterface.register(VARLEN, _make_varlen_attention(options))
    return VARLEN
