"""Causal-only SDPA for right-padded training batches: the flash kernel under ``torch.compile``.

Why it exists: transformers builds a 4-D attention mask whenever Dynamo traces the model
(``masking_utils._ignore_causal_mask_sdpa`` returns False while ``is_tracing()``), even when
the batch has no padding at all. With a mask, ``scaled_dot_product_attention`` cannot take
its flash kernel, and ``sdpa_attention_forward`` repeats K and V over the query groups
(``repeat_kv``) instead of passing ``enable_gqa``, so the backward keeps 4x the K/V of
Llama-3's grouped attention. Eager runs skip the mask when nothing is padded; compiled runs
never do.

For causal-LM training on *right*-padded batches the mask is not needed: a real token at
position ``i`` attends to positions ``<= i``, which are all real, so the causal flag alone gives
real tokens exactly the attention the padding mask would; only the pad positions' outputs
differ, and their labels are ``-100``. :func:`use_causal_sdpa` switches a model to an attention
implementation registered with transformers' own ``AttentionInterface`` and
``AttentionMaskInterface`` (no monkey-patching): the mask function builds nothing and the
attention is the stock ``sdpa_attention_forward`` called without a mask. It is reversible
(``handle.undo()``), and :func:`check_right_padded` refuses batches where it would be wrong
(a pad before a real token, i.e. left padding or holes).

Not for generation with a cache or for left-padded batches; packed sequences also need their
own mask (document boundaries), which this drops.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .patches._base import PatchHandle

__all__ = ["CAUSAL_SDPA", "register_causal_sdpa", "use_causal_sdpa", "check_right_padded"]

#: The name the implementation is registered under in transformers' interfaces.
CAUSAL_SDPA = "qlora_causal_sdpa"


def _no_mask(*args, **kwargs) -> None:
    """The mask function: no mask at all (SDPA's ``is_causal`` does the causal part)."""
    return None


def _causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """``sdpa_attention_forward`` without a mask: ``is_causal=True``, GQA without repeating K/V."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def register_causal_sdpa() -> str:
    """Register :data:`CAUSAL_SDPA` with transformers (idempotent); return the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL_SDPA, _causal_sdpa)
    AttentionMaskInterface.register(CAUSAL_SDPA, _no_mask)
    return CAUSAL_SDPA


def _configs(model: torch.nn.Module) -> list:
    seen, out = set(), []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


def use_causal_sdpa(model: torch.nn.Module) -> PatchHandle:
    """Switch ``model`` (a transformers model, PEFT-wrapped or not) to causal-only SDPA.

    Sets ``_attn_implementation`` on every config the model's modules hold; ``undo()`` puts
    the previous values back. Call it before compiling (the implementation name is read at
    trace time).

    Raises:
        ValueError: the model has no transformers config, or does not use ``sdpa`` now
            (``eager`` and ``flex_attention`` keep their own masks; switching them silently
            would change more than the mask).
    """
    configs = _configs(model)
    if not configs:
        raise ValueError(f"{type(model).__name__} holds no transformers config with an attention implementation")
    current = {cfg._attn_implementation for cfg in configs}
    if not current <= {"sdpa", CAUSAL_SDPA}:
        raise ValueError(f"use_causal_sdpa expects a model using 'sdpa' attention, found {sorted(current)}")
    register_causal_sdpa()
    handle = PatchHandle("causal_sdpa", {"configs": len(configs)})
    for cfg in configs:
        # a property on PretrainedConfig: restore by setting the old value, never by deleting
        old = cfg._attn_implementation
        cfg._attn_implementation = CAUSAL_SDPA
        handle.add_undo(lambda cfg=cfg, old=old: setattr(cfg, "_attn_implementation", old))
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
