"""What a model's attention does beyond causal softmax, and attention that keeps it when compiled.

Why it exists: the fast path's attention is causal-only SDPA, and SDPA computes
``softmax(q k^T * scale + mask) v`` and nothing else. Some models change the scores on the way:
Gemma-2 caps them (``c * tanh(s / c)``, ``attn_logit_softcapping``, 50 in its released
configs), gpt-oss adds a learned sink to each softmax, T5-like models add a position bias.
transformers' own ``sdpa_attention_forward`` drops all three without a word, so a model loaded
with ``attn_implementation="sdpa"`` (transformers' default) trains with gradients its attention
does not define; its eager and flex-attention paths keep them. Scaling (Gemma's
``query_pre_attn_scalar``, Granite's ``attention_multiplier``) reaches SDPA as its ``scale``, and
sliding windows live in the mask, so those are kept by the mask paths already.

What the model does is read from it, not assumed from its name: one probe forward records what
every layer passes to its attention (``softcap``, ``s_aux``, ``position_bias``, ``sliding_window``,
``dropout``, anything unknown; :func:`~qlora_nb_utils.models.attention_scores.read_attention`).
:func:`~qlora_nb_utils.compile.choices.choose_attention` then keeps what SDPA would drop:

* **Flex attention with the change as a score modification** (:data:`FLEX_SCORES`, CUDA):
  transformers' own ``flex_attention_forward``, which applies ``softcap`` (and ``s_aux``,
  ``position_bias``) inside flex attention's ``score_mod``, given causal ``BlockMask``s built
  outside the compiled graph (:func:`with_block_masks`), one per sliding window the model's
  layers use: each layer takes the mask of the window it passes (``sliding_window``), so a
  Gemma-2 gets its cap on every layer and its window on the layers that have one. The masks
  are cached per length, so the graph takes them as inputs and no mask code runs in it (the
  same route as :func:`~qlora_nb_utils.ops.attention.with_causal_block_mask`). Without the
  masks (a call outside the fast path: evaluation, generation) the implementation builds the
  model's own masks, padding included, as stock flex attention does.
* **The model's own eager attention** where flex attention cannot train: on a CPU (torch has
  no flex-attention backward there), with attention dropout (flex attention has none), or on
  batches that are not right-padded (the causal block masks assume right padding).

Packed rows take the same choice through their per-document mask
(:func:`~qlora_nb_utils.compile.choices.choose_doc_kernel`): flex attention's ``score_mod`` keeps
the cap beside the document ``BlockMask``, and elsewhere the dense document mask is given to the
eager attention as an additive mask (:func:`~qlora_nb_utils.ops.doc_attention.document_additive_mask`).

The switch is reversible (:func:`use_attention`: the configs' ``_attn_implementation``, read at
trace time); no library code is patched.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..models.attention_scores import AttentionScores, read_attention
from ..reversible import PatchHandle
from .attention import cached_block_mask, model_configs

__all__ = ["AttentionScores", "read_attention", "FLEX_SCORES", "MASKS_KWARG", "register_flex_scores",
           "use_attention", "block_masks", "with_block_masks", "MODEL_ATTENTION"]

#: The name the flex implementation that keeps the model's score changes is registered under.
FLEX_SCORES = "qlora_nb_flex_scores"
#: The keyword :func:`with_block_masks` passes the per-window masks in (it reaches every attention call).
MASKS_KWARG = "qlora_block_masks"
#: ``optimize()``'s attention choices that keep the model's score changes: implementation names.
MODEL_ATTENTION = {"flex": FLEX_SCORES, "eager": "eager"}
def _flex_scores(module, query, key, value, attention_mask, sliding_window=None, **kwargs):
    """transformers' ``flex_attention_forward`` (the model's ``softcap``, ``s_aux`` and ``position_bias``
    in its ``score_mod``), with the ``BlockMask`` of this layer's window where :func:`with_block_masks`
    passed them; else with the mask transformers built (a call outside the fast path)."""
    from transformers.integrations.flex_attention import flex_attention_forward

    masks = kwargs.pop(MASKS_KWARG, None)
    if masks is not None:
        window = int(sliding_window or 0)
        if window not in masks:
            raise ValueError(f"a layer attends within a sliding window of {window} tokens, and the block masks "
                             f"given are for {sorted(masks)}: build them with every window the model uses")
        attention_mask = masks[window]
    return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_flex_scores() -> str:
    """Register :data:`FLEX_SCORES` with transformers (idempotent); return the name.

    The mask function is stock flex attention's (padding and windows, built by transformers) for
    calls that pass no ``BlockMask``; a ``BlockMask`` given as ``attention_mask`` is taken as it is.

    Raises:
        ValueError: this torch has no flex attention.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.utils import is_torch_flex_attn_available

    if not is_torch_flex_attn_available():
        raise ValueError(f"flex attention needs torch >= 2.5; torch {torch.__version__} is installed")
    AttentionInterface.register(FLEX_SCORES, _flex_scores)
    AttentionMaskInterface.register(FLEX_SCORES, AttentionMaskInterface._global_mapping["flex_attention"])
    return FLEX_SCORES


def use_attention(model: torch.nn.Module, name: str) -> PatchHandle:
    """Make every config ``model``'s modules hold name ``name`` as its attention implementation until ``undo()``.

    ``name``: a registered implementation (``"eager"``, :data:`FLEX_SCORES`, registered here on first
    use). Call it before compiling (the name is read at trace time).

    Raises:
        ValueError: the model holds no transformers config.
    """
    if name == FLEX_SCORES:
        register_flex_scores()
    configs = model_configs(model)
    if not configs:
        raise ValueError(f"{type(model).__name__} holds no transformers config with an attention implementation")
    handle = PatchHandle("model_attention", {"configs": len(configs), "implementation": name})
    for cfg in configs:
        old = cfg._attn_implementation  # a property: restore by setting the old value
        cfg._attn_implementation = name
        handle.add_undo(lambda cfg=cfg, old=old: setattr(cfg, "_attn_implementation", old))
    return handle


def block_masks(seq_len: int, device: str | torch.device, windows: tuple[int, ...] = (),
                block_size: int = 128) -> dict[int, Any]:
    """The causal ``BlockMask`` of ``seq_len`` tokens (key 0) and one per sliding window (key: the
    window), built eagerly and cached per (length, device, window).

    Raises:
        RuntimeError: called while ``torch.compile`` traces.
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("block_masks runs outside the compiled graph: wrap the compiled model with "
                           "with_block_masks(torch.compile(model), ...), not the reverse")
    where = str(torch.device(device))
    return {w: cached_block_mask(seq_len, where, block_size, w or None) for w in (0, *windows)}


def _check_windows(windows: tuple) -> tuple[int, ...]:
    for w in windows:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"a sliding window must be a positive int, got {w!r}")
    return tuple(windows)


def with_block_masks(forward: Callable, windows: tuple[int, ...] = (), block_size: int = 128) -> Callable:
    """Wrap ``forward`` (a model under :data:`FLEX_SCORES`, or its compiled twin) to run on right-padded
    batches with causal block masks built outside it (:func:`block_masks`).

    The batch's 2-D ``attention_mask`` is replaced by the causal ``BlockMask`` (so transformers
    builds no mask), and every attention call gets the masks by window (:data:`MASKS_KWARG`). The
    batch's data is not read: check right padding once
    (:func:`~qlora_nb_utils.ops.attention.check_right_padded`).

    Raises:
        ValueError: a window is not a positive int; when called: no ``input_ids`` to size the masks.
    """
    windows = _check_windows(tuple(windows))

    def run(*args, **batch):
        ids = batch.get("input_ids")
        if ids is None:
            raise ValueError("with_block_masks needs input_ids (keyword) to size the masks")
        masks = block_masks(int(ids.shape[1]), ids.device, windows, block_size)
        batch["attention_mask"] = masks[0]
        batch[MASKS_KWARG] = masks
        return forward(*args, **batch)

    return run
