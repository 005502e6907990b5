"""Causal-only attention for right-padded training batches: one graph under ``torch.compile``.

Why it exists: transformers builds a padding mask whenever Dynamo traces the model, and what
that costs depends on the kernel.

* **SDPA.** ``masking_utils._ignore_causal_mask_sdpa`` returns False while ``is_tracing()``, so a
  compiled model always gets a 4-D mask, even for a batch without padding. With a mask,
  ``scaled_dot_product_attention`` cannot take its flash kernel, and ``sdpa_attention_forward``
  repeats K and V over the query groups (``repeat_kv``) instead of passing ``enable_gqa``, so
  the backward keeps 4x the K/V of Llama-3's grouped attention.
* **flex_attention.** ``masking_utils.flex_attention_mask`` (transformers 5.17, line 685) asks
  ``if attention_mask is not None and not fast_all(attention_mask)``, a branch on tensor data:
  compiling the whole model breaks the graph there and ``fullgraph=True`` fails. Dropping the
  2-D mask alone is not enough: the function then calls ``create_block_mask(..., _compile=True)``,
  whose deprecation ``warnings.warn`` (torch 2.13, ``flex_attention.py:1912``) is a graph break
  too, in every layer.

For causal-LM training on *right*-padded batches the padding mask is not needed: a real token
at position ``i`` attends to positions ``<= i``, which are all real, so the causal mask alone
gives real tokens exactly the attention the padding mask would; only the pad positions' outputs
differ, and their labels are ``-100``. :func:`use_causal_attention` switches a model to an
implementation registered with transformers' own ``AttentionInterface`` and
``AttentionMaskInterface`` (no monkey-patching); the attention functions are transformers' own:

* ``"sdpa"`` (:func:`use_causal_sdpa`): the mask function builds nothing and
  ``sdpa_attention_forward`` runs without a mask (``is_causal=True``, GQA without ``repeat_kv``).
* ``"flex_attention"`` (:func:`use_causal_flex`): the mask function builds the ``BlockMask``
  transformers would build, minus the padding: the model's own ``mask_function`` (causal; a
  sliding window or packed sequences where the model composes them) with the cache offsets,
  through ``create_block_mask`` called directly (no ``_compile``, no warning), once per forward
  and inside the traced graph, from the lengths Dynamo sees as symbols. The attention is
  ``flex_attention_forward`` given that ``BlockMask``: block-sparse causal attention,
  ``enable_gqa=True`` (transformers repeats K/V only when the query heads per device are not a
  power of two), its scaling and its (B, S, H, D) output.

How it compiles (tiny Llama on a CPU, torch 2.13, forward only: torch has no flex backward on
a CPU): the whole model traces as one graph, ``fullgraph=True`` compiles, and the loss equals
the padding-masked SDPA loss. Over variable lengths with the sequence dimension dynamic it
compiles **once per side of 128**: ``create_block_mask`` gives a ``ceil(S / 128)``-block mask,
and Dynamo specialises a 1-block mask (S <= 128) apart from the rest, so lengths on both sides
take 2 compilations (3 with ``dynamic=None``: the first one static). Building the mask in each
attention call instead (from the query and key lengths) behaves the same but traces one mask
per layer, so it compiles slower; a causal ``score_mod`` without a
``BlockMask`` compiles once for all lengths but computes every block of the upper triangle too.
Gradients cannot be checked on a CPU; ``tests/test_attention.py`` compares them on a GPU.

**The mask built outside the graph** (:func:`causal_block_mask`, :func:`with_causal_block_mask`).
transformers takes a ``BlockMask`` passed as ``attention_mask`` as it is
(``masking_utils._preprocess_mask_arguments`` returns it before any mask code runs), so a stock
``flex_attention`` model can be given the causal ``BlockMask`` built eagerly, once per length
(cached), with no mask code in the compiled graph at all. The graph then takes the mask's
block counts and indices as inputs, sized by a block-count symbol of their own, instead of
computing them from ``ceil(S / 128)``: that computation is what Inductor could not split on a
GPU (``use_causal_flex``'s docstring). On a CPU (tiny Llama, forward, Inductor) it compiles
like the in-graph mask: one static graph, one dynamic graph for every length over 128, one
more for a 1-block length. On a GPU the whole 1B-shape QLoRA trains lengths on both sides of
128 without graph breaks under ``fullgraph=True``, compiling once per side, and the loss and
gradients equal stock flex with the padding mask (the lab's flex-attention record).
The mask function is a module-level function, so its identity guard holds from call to call.

**cuDNN's kernel first** (:data:`CAUSAL_SDPA_CUDNN`, ``use_causal_sdpa(model, cudnn=True)``): the
same causal-only SDPA inside ``sdpa_kernel([cuDNN, flash, efficient, math], set_priority=True)``,
a context Dynamo traces (no graph break), so the compiled graph holds cuDNN's attention and its
backward. At long sequences on Hopper GPUs it trains attention faster than SDPA's default
choice, the flash kernel; where cuDNN cannot take the inputs SDPA falls through to the next.
``optimize(sdpa_kernel="auto")`` takes it there after a probe of the model's attention shape.

Not for generation with a cache or for left-padded batches (:func:`check_right_padded` refuses
those). Decoder-only causal LMs only: an encoder's bidirectional mask without the padding would
let real tokens see pads. The SDPA variant also drops what transformers adds to the causal mask
(a sliding window; packed-sequence boundaries, derived from ``position_ids`` when no
``attention_mask`` is given); the flex variant passes them on (not tested here). Train with
``use_cache=False``: with a ``DynamicCache`` the flex path does not trace on transformers 5.17,
with this mask or with none (an ``AttributeError`` on the cache layer's ``dtype``).
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch

from ..reversible import PatchHandle

__all__ = ["CAUSAL_SDPA", "CAUSAL_SDPA_CUDNN", "SDPA_KERNELS", "cudnn_attention_works", "CUDNN_FIRST_CAPABILITIES",
           "CUDNN_MIN_POSITIONS", "CAUSAL_FLEX", "KERNELS", "register_causal", "register_causal_sdpa",
           "use_causal_attention", "sliding_window", "longest_document", "model_configs", "cached_block_mask", "no_mask",
           "use_causal_sdpa", "use_causal_flex", "causal_masks_for", "check_right_padded", "causal_block_mask",
           "with_causal_block_mask"]

#: The names the implementations are registered under in transformers' interfaces.
CAUSAL_SDPA = "qlora_causal_sdpa"
#: :data:`CAUSAL_SDPA` with SDPA's cuDNN kernel first (then flash, memory-efficient, math).
CAUSAL_SDPA_CUDNN = "qlora_causal_sdpa_cudnn"
#: ``optimize(sdpa_kernel=...)``'s values: ``"auto"`` (:func:`~qlora_nb_utils.compile.choices.choose_sdpa_kernel`), ``"cudnn"``, ``"default"``.
SDPA_KERNELS = ("auto", "cudnn", "default")
#: The compute capabilities where ``"auto"`` takes cuDNN's kernel: Hopper, where it was measured
#: faster than SDPA's flash kernel for causal training (the lab's attention-backend record).
CUDNN_FIRST_CAPABILITIES = ((9, 0),)
#: The shortest row (positions) for which ``"auto"`` takes cuDNN's kernel: on Hopper its gain in a
#: whole QLoRA step grew with the length and was nil at 8k positions (the lab's records).
CUDNN_MIN_POSITIONS = 16384
CAUSAL_FLEX = "qlora_causal_flex"
#: The kernel a model uses now -> the causal-only implementation it can switch to.
KERNELS = {"sdpa": CAUSAL_SDPA, "flex_attention": CAUSAL_FLEX}


def no_mask(*args, **kwargs) -> None:
    """The SDPA mask function: no mask at all (SDPA's ``is_causal`` does the causal part)."""
    return None


def _causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """``sdpa_attention_forward`` without a mask: ``is_causal=True``, GQA without repeating K/V."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def _cudnn_first():
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _causal_sdpa_cudnn(module, query, key, value, attention_mask, **kwargs):
    """:func:`_causal_sdpa` with cuDNN's kernel first: where it cannot take the inputs (or there is
    no CUDA), SDPA takes the next in order, as it would by default."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_cudnn_first(), set_priority=True):
        return _causal_sdpa(module, query, key, value, attention_mask, **kwargs)


def _causal_block_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                       device="cpu", **kwargs):
    """The flex mask function: ``flex_attention_mask`` without the padding mask and its data branch.

    ``attention_mask`` (the 2-D padding mask) arrives in ``kwargs`` and is ignored. Nothing here
    reads tensor data, so Dynamo traces it into the model's graph.
    """
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.masking_utils import add_offsets_to_mask_function, causal_mask_function

    mask_mod = add_offsets_to_mask_function(mask_function or causal_mask_function, q_offset, kv_offset)
    return create_block_mask(mask_mod, B=batch_size, H=None, Q_LEN=q_length, KV_LEN=kv_length, device=device)


def _implementation(kernel: str, cudnn: bool = False):
    """(name, attention function, mask function) of the causal-only twin of ``kernel``."""
    if cudnn and kernel != "sdpa":
        raise ValueError(f"cuDNN's kernel is an SDPA kernel; the model uses {kernel!r}")
    if kernel == "sdpa":
        return (CAUSAL_SDPA_CUDNN, _causal_sdpa_cudnn, no_mask) if cudnn else (CAUSAL_SDPA, _causal_sdpa, no_mask)
    if kernel == "flex_attention":
        from transformers.utils import is_torch_flex_attn_available

        if not is_torch_flex_attn_available():
            raise ValueError(f"flex_attention needs torch >= 2.5; torch {torch.__version__} is installed")
        from transformers.integrations.flex_attention import flex_attention_forward

        return CAUSAL_FLEX, flex_attention_forward, _causal_block_mask
    raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")


def register_causal(kernel: str, cudnn: bool = False) -> str:
    """Register the causal-only twin of ``kernel`` with transformers (idempotent); return its name.

    Raises:
        ValueError: ``kernel`` is not in :data:`KERNELS` (or flex attention is unavailable).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name, attention_fn, mask_fn = _implementation(kernel, cudnn)
    AttentionInterface.register(name, attention_fn)
    AttentionMaskInterface.register(name, mask_fn)
    return name


def register_causal_sdpa() -> str:
    """Register :data:`CAUSAL_SDPA` with transformers (idempotent); return the name."""
    return register_causal("sdpa")


def model_configs(model: torch.nn.Module) -> list:
    """Every config ``model`` carries that names an attention implementation, once each (a PEFT
    wrapper, the causal LM and its decoder may share one): what switching the attention changes."""
    seen, out = set(), []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


def use_causal_attention(model: torch.nn.Module, kernel: str, cudnn: bool = False) -> PatchHandle:
    """Switch ``model`` (a transformers causal LM, PEFT-wrapped or not) to causal-only ``kernel``.

    Sets ``_attn_implementation`` on every config the model's modules hold; ``undo()`` puts
    the previous values back. Call it before compiling (the implementation name is read at
    trace time). The kernel stays the one the model was loaded with: ``"sdpa"`` becomes
    :data:`CAUSAL_SDPA`, ``"flex_attention"`` becomes :data:`CAUSAL_FLEX`.

    Args:
        model: The model; only right-padded batches may be fed to it afterwards.
        kernel: ``"sdpa"`` or ``"flex_attention"``, the implementation the model uses now.
        cudnn: with ``"sdpa"``, SDPA's cuDNN kernel first (:data:`CAUSAL_SDPA_CUDNN`).

    Returns:
        A :class:`PatchHandle` (also a context manager) whose ``undo()`` restores the configs.

    Raises:
        ValueError: ``kernel`` is unknown, the model has no transformers config, or it does
            not use ``kernel`` now (switching kernels silently would change more than the mask).
    """
    name = register_causal(kernel, cudnn)
    short = {"sdpa": "sdpa", "flex_attention": "flex"}[kernel]
    configs = model_configs(model)
    if not configs:
        raise ValueError(f"{type(model).__name__} holds no transformers config with an attention implementation")
    current = {cfg._attn_implementation for cfg in configs}
    twins = {CAUSAL_SDPA, CAUSAL_SDPA_CUDNN} if kernel == "sdpa" else {name}
    if not current <= {kernel, *twins}:
        raise ValueError(f"use_causal_{short} expects a model using {kernel!r} attention, found {sorted(current)}; "
                         f"load it with attn_implementation={kernel!r}")
    handle = PatchHandle(f"causal_{short}", {"configs": len(configs), "implementation": name})
    for cfg in configs:
        # a property on PretrainedConfig: restore by setting the old value, never by deleting
        old = cfg._attn_implementation
        cfg._attn_implementation = name
        handle.add_undo(lambda cfg=cfg, old=old: setattr(cfg, "_attn_implementation", old))
    return handle


def use_causal_sdpa(model: torch.nn.Module, cudnn: bool = False) -> PatchHandle:
    """:func:`use_causal_attention` for a model loaded with ``attn_implementation="sdpa"``; ``cudnn``:
    SDPA's cuDNN kernel first."""
    return use_causal_attention(model, "sdpa", cudnn)


def cudnn_attention_works(device: torch.device, heads: int, kv_heads: int, head_dim: int,
                          dtype: torch.dtype) -> tuple[bool, str]:
    """Whether SDPA's cuDNN kernel alone runs causal attention of this shape, forward and backward,
    on ``device`` (a probe of 256 positions); and why not."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "cuDNN attention needs CUDA"
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False, "cuDNN attention is turned off (torch.backends.cuda.enable_cudnn_sdp)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        q = torch.randn(1, heads, 256, head_dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, kv_heads, 256, head_dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                   enable_gqa=heads != kv_heads)
        out.sum().backward()
        torch.cuda.synchronize(device)
    except RuntimeError as exc:  # "No available kernel", a cuDNN error: SDPA's default then
        return False, f"cuDNN attention refused a probe of this shape ({str(exc).splitlines()[0][:120]})"
    return True, ""


def use_causal_flex(model: torch.nn.Module) -> PatchHandle:
    """:func:`use_causal_attention` for a model loaded with ``attn_implementation="flex_attention"``.

    The compiled whole model is then one graph (no break in the mask code), and variable
    lengths compile once per side of 128 tokens with the sequence dimension dynamic (see the
    module docstring). On a GPU, torch 2.11's Inductor could not generate the whole model's
    dynamic graph (``CantSplit: ((s + 127)//128) not divisible by ...``, also with the lengths
    declared multiples of 128 through ``torch._check``): there, build the mask outside the graph
    instead (:func:`with_causal_block_mask`: the whole 1B QLoRA then compiles once per side of
    128), or compile regionally (``prepare_for_compile(scope="regional")``: a few compilations
    over any number of lengths).
    """
    return use_causal_attention(model, "flex_attention")


def causal_masks_for(kernel: str) -> PatchHandle:
    """Give every model that uses ``kernel`` the causal-only mask until ``undo()``.

    For code that loads the model itself (``qlora-nb diagnose --causal-attn``): instead of
    renaming one model's implementation, the mask function registered under the stock name
    is replaced, through transformers' ``AttentionMaskInterface.register``, and put back by
    ``undo()``. The attention functions stay transformers' own; with no mask, SDPA runs
    causal, as in :func:`use_causal_sdpa`. Prefer :func:`use_causal_attention` where you hold
    the model: this one reaches every model in the process.

    Raises:
        ValueError: ``kernel`` is not in :data:`KERNELS`.
    """
    from transformers.masking_utils import AttentionMaskInterface

    _, _, mask_fn = _implementation(kernel)
    old = AttentionMaskInterface()[kernel]  # a fresh instance has no local overrides: the global entry
    handle = PatchHandle("causal_masks", {"kernel": kernel})
    AttentionMaskInterface.register(kernel, mask_fn)
    handle.add_undo(lambda: AttentionMaskInterface.register(kernel, old))
    return handle


def check_right_padded(batches: Iterable[dict]) -> int:
    """Raise unless every row of every batch is real tokens followed only by padding.

    Args:
        batches: dicts with ``attention_mask`` (rows of 1s then 0s); a batch without one has
            no padding and passes.

    Returns:
        How many batches were checked.

    Raises:
        ValueError: a 0 before a 1 in some row (left padding or a hole), with the batch index.
    """
    n = 0
    for i, batch in enumerate(batches):
        n += 1
        mask = batch.get("attention_mask")
        if mask is None:
            continue
        mask = torch.as_tensor(mask).bool()
        if mask.dim() != 2:
            raise ValueError(f"batch {i}: attention_mask must be 2-D (batch, seq), got shape {tuple(mask.shape)}")
        if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            raise ValueError(f"batch {i} is not right-padded (a padding position comes before a real token); "
                             "causal-only attention would let real tokens see the padding")
    return n


def _causal_mod(batch, head, q_idx, kv_idx):
    """``mask_mod`` of the precomputed causal ``BlockMask``: module-level, so Dynamo's guard on it holds."""
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=None)
def _window_mod(window: int):
    """The causal ``mask_mod`` within a sliding window of ``window`` tokens (transformers' rule: a key
    more than ``window - 1`` positions back is not seen); one function per window, so guards hold."""

    def window_mod(batch, head, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx > q_idx - window)

    return window_mod


@functools.lru_cache(maxsize=64)
def cached_block_mask(seq_len: int, device: str, block_size: int, window: int | None = None):
    """The causal ``BlockMask`` of ``seq_len`` (within ``window`` tokens when given), built once per
    length, device, block size and window: the mask a forward outside the graph hands the model."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod = _causal_mod if window is None else _window_mod(window)
    mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device,
                             BLOCK_SIZE=block_size)
    # The block counts are dynamic from the first compile on: without this, a compile whose
    # lengths share a block count keeps that count static, and the next count recompiles.
    # A 1-block mask stays static (Dynamo specialises sizes 0 and 1 anyway).
    if mask.kv_indices.shape[-1] > 1:
        for t in (mask.kv_num_blocks, mask.full_kv_num_blocks, mask.q_num_blocks, mask.full_q_num_blocks):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, t.dim() - 1)  # dims count from 0 here, never -1
        for t in (mask.kv_indices, mask.full_kv_indices, mask.q_indices, mask.full_q_indices):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2)
                torch._dynamo.maybe_mark_dynamic(t, t.dim() - 1)
    return mask


def causal_block_mask(seq_len: int, device: str | torch.device = "cpu", block_size: int = 128):
    """The causal ``BlockMask`` for ``seq_len`` tokens, built eagerly and cached per (length, device).

    Broadcast over batch and heads (``B=None, H=None``). Pass it as ``attention_mask`` to a model
    loaded with ``attn_implementation="flex_attention"`` (transformers uses it as given), on
    right-padded batches only: see the module docstring for why the padding mask is not needed.

    Raises:
        ValueError: ``seq_len`` or ``block_size`` is not a positive int.
        RuntimeError: called while ``torch.compile`` traces: the point is a mask built outside the
            graph, so wrap the compiled model (:func:`with_causal_block_mask`), not the reverse.
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("causal_block_mask runs outside the compiled graph: wrap the compiled model with "
                           "with_causal_block_mask(torch.compile(model)), not torch.compile(with_causal_block_mask(...))")
    for name, value in (("seq_len", seq_len), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return cached_block_mask(seq_len, str(torch.device(device)), block_size)


def with_causal_block_mask(forward, block_size: int = 128):
    """Wrap ``forward`` (a model or its compiled twin) to run with :func:`causal_block_mask`.

    The wrapper replaces the batch's 2-D ``attention_mask`` by the causal ``BlockMask`` of the
    batch's length (``input_ids.shape[1]``) on the batch's device; everything else passes
    through. It does not read the batch's data (no device sync per step): check the batches
    once with :func:`check_right_padded`.

    Raises:
        ValueError (when called): no ``input_ids`` to take the length from.
    """

    def run(*args, **batch):
        ids = batch.get("input_ids")
        if ids is None:
            raise ValueError("with_causal_block_mask needs input_ids (keyword) to size the mask")
        batch["attention_mask"] = causal_block_mask(ids.shape[1], ids.device, block_size)
        return forward(*args, **batch)

    return run


def sliding_window(model: torch.nn.Module) -> int | None:
    """The sliding window (in tokens) some layer of ``model`` attends within, or None when none does.

    Read from the config (``sliding_window``; with ``layer_types``, only when some layer is
    ``"sliding_attention"``): Mistral, Gemma-2/3, Qwen2 with ``use_sliding_window`` and their kin.
    """
    for cfg in model_configs(model):
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        if isinstance(window, int) and not isinstance(window, bool) and window > 0 and (
                types is None or "sliding_attention" in types):
            return window
    return None


def longest_document(batches: Iterable[dict]) -> int:
    """The most tokens one document spans in packed rows (runs of equal ``document_ids``)."""
    most = 0
    for batch in batches:
        for row in batch["document_ids"].reshape(-1, batch["document_ids"].shape[-1]):
            ids, counts = torch.unique_consecutive(row, return_counts=True)
            real = counts[ids >= 0]  # padding's document id is negative: it attends to nothing that matters
            most = max(most, int(real.max()) if real.numel() else 0)
    return most


